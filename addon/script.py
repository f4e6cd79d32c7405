"""Load with ``mitmdump -s <this file> --set stepmill_db=steps.db``."""

from stepmill.addon.capture import StepmillAddon

addons = [StepmillAddon()]
