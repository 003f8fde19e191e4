"""Pretrained models asyncrl can provision offline from PyPI wheels (no model hub on the machine)."""
