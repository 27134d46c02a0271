"""Runtime: process topology, heterogeneous pipeline, DP/TP, checkpointing, export, metrics, trainer loop."""
