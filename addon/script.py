"""Load with ``mitmdump -s <this file> --set stepmill_db=steps.db``."""

from stepmill.addon.main import StepmillAddon

addons = [StepmillAddon()]
