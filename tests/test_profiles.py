"""`dflop install-profile` puts the bundled profiles where `snakemake --profile NAME` finds them."""

from pathlib import Path

import pytest
import yaml

from dflop.errors import UserError
from dflop.profiles import install_profile

REPO = Path(__file__).resolve().parents[1]


def test_install_slurm_profile_copies_the_checkout_profile(tmp_path):
    dest = install_profile("slurm", tmp_path)
    assert dest == tmp_path / "slurm"
    assert (dest / "config.yaml").read_text() == (REPO / "profiles/slurm/config.yaml").read_text()
    assert yaml.safe_load((dest / "config.yaml").read_text())["executor"] == "slurm"


def test_install_refuses_to_overwrite_without_force(tmp_path):
    install_profile("local", tmp_path)
    (tmp_path / "local" / "config.yaml").write_text("cores: 1\n")
    with pytest.raises(UserError, match="already exists"):
        install_profile("local", tmp_path)
    install_profile("local", tmp_path, force=True)
    assert "cores: all" in (tmp_path / "local" / "config.yaml").read_text()
