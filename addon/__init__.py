"""What runs on mitmproxy's event loop: the stepmill addons (``main.StepmillAddon``), which recognise
agents' LLM calls, move their bytes and hand each finished call to the pipeline as a record.
Importing this package loads none of them (the CLI only wants ``SCRIPT``)."""

# This folder is the package stepmill.addon. Imported under another name (``import addon`` from the
# repository root) its modules would load twice, as two sets of classes that are not the same.
if __name__ != "stepmill.addon":
    raise ImportError(f"import stepmill.addon, not {__name__}: this folder is installed as stepmill.addon")

from pathlib import Path  # noqa: E402

SCRIPT = str(Path(__file__).with_name("script.py"))  # what `mitmdump -s` loads

__all__ = ["SCRIPT"]
