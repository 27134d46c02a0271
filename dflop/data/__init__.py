"""Data layer: dataset readers, per-sample shapes, torch Dataset and collate, demo data."""
