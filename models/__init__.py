"""Signed model artifacts shipped with the package (see models/demo/README.md).

A package so that it installs with the project and is bound read-only into the
sandboxes like the other project packages; nothing here is imported as code."""
from pathlib import Path

DEMO = Path(__file__).resolve().parent / "demo"
DEMO_ARTIFACT = DEMO / "lane-offset"
DEMO_PUBKEY = DEMO / "demo_ed25519.pub"
