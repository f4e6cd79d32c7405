"""mitmproxy's onboarding page (http://mitm.it, the CA for a browser or a phone), loaded on its first
request instead of at start.

The page is a Flask app that mitmproxy imports with its default addons: Flask and Jinja2 are ~20 MiB
in every proxy worker, for a page agents never open. ``defer()``, called before mitmproxy's addons are
imported, puts a stand-in for the app's module in place; the onboarding addon holds the stand-in's app,
which imports the real one the first time the page is asked for.
"""

from __future__ import annotations

import sys
import threading
import types
from importlib.machinery import PathFinder
from importlib.util import module_from_spec

MODULE = "mitmproxy.addons.onboardingapp"


class DeferredApp:
    """What the onboarding addon holds as its ``app``: the ``config`` it sets on every configure, and
    the WSGI call, which it runs in a thread of its own."""

    def __init__(self):
        self.config: dict = {}
        self._app = None
        self._lock = threading.Lock()

    def __call__(self, environ, start_response):
        with self._lock:
            if self._app is None:
                self._app = _import_real_app()
            self._app.config.update(self.config)
        return self._app(environ, start_response)


def _import_real_app():
    import mitmproxy.addons

    spec = PathFinder.find_spec(MODULE, mitmproxy.addons.__path__)  # past the stand-in in sys.modules
    module = module_from_spec(spec)
    sys.modules[MODULE] = module  # Flask finds its templates through the module's file
    spec.loader.exec_module(module)
    return module.app


def defer() -> None:
    """Before mitmproxy's addons are imported; a no-op once they are."""
    if MODULE in sys.modules:
        return
    stand_in = types.ModuleType(MODULE)
    stand_in.app = DeferredApp()
    sys.modules[MODULE] = stand_in
