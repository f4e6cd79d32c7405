"""The mitmproxy addon that captures agents' LLM calls as step records."""

from pathlib import Path

SCRIPT = str(Path(__file__).with_name("script.py"))  # what `mitmdump -s` loads

__all__ = ["SCRIPT"]
