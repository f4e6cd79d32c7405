"""The mitmproxy CA, a trust bundle around it, and the environment an agent needs to use the proxy."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

DEFAULT_CONFDIR = "~/.mitmproxy"
SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Alpine
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL
    "/etc/ssl/cert.pem",  # macOS, BSD
)


def confdir_path(confdir: str | None) -> Path:
    return Path(os.path.expanduser(confdir or DEFAULT_CONFDIR))


def ensure_ca(confdir: str | None = None) -> Path:
    """The mitmproxy CA certificate, created on first use."""
    path = confdir_path(confdir)
    if not (path / "mitmproxy-ca.pem").exists() or not (path / "mitmproxy-ca-cert.pem").exists():
        # Only then: mitmproxy's certificate code is ~10 MiB in a process (the proxy's supervisor) that needs no more.
        from mitmproxy.certs import CertStore

        CertStore.from_store(path, "mitmproxy", 2048)
    return path / "mitmproxy-ca-cert.pem"


def system_bundle() -> str | None:
    candidates = [ssl.get_default_verify_paths().cafile, *SYSTEM_BUNDLES]
    try:
        import certifi

        candidates.append(certifi.where())
    except ImportError:
        pass
    return next((c for c in candidates if c and os.path.isfile(c)), None)


def ensure_bundle(confdir: str | None = None) -> Path:
    """System CAs plus the mitmproxy CA in one file, so other hosts stay trusted."""
    ca = ensure_ca(confdir)
    bundle = ca.with_name("stepmill-ca-bundle.pem")
    parts = []
    system = system_bundle()
    if system:
        parts.append(Path(system).read_text())
    parts.append(ca.read_text())
    text = "\n".join(p.rstrip("\n") + "\n" for p in parts)
    if not bundle.exists() or bundle.read_text() != text:
        bundle.write_text(text)
    return bundle


def trust_env(bundle: str) -> dict[str, str]:
    """Every client's way to trust ``bundle`` (system CAs plus the mitmproxy CA)."""
    return {
        "SSL_CERT_FILE": bundle,  # OpenSSL, Python's ssl, httpx
        "REQUESTS_CA_BUNDLE": bundle,  # requests
        "CURL_CA_BUNDLE": bundle,
        "NODE_EXTRA_CA_CERTS": bundle,  # Node (Claude Code)
        "CODEX_CA_CERTIFICATE": bundle,  # Codex CLI
    }


def agent_env(host: str, port: int, confdir: str | None = None, trajectory: str | None = None,
              group: str | None = None, secret: str | None = None, bundle: str | None = None) -> dict[str, str]:
    """``secret``: a registered run's (its credentials then carry it instead of the group);
    ``bundle``: the trust bundle's path as the agent sees it (default: the confdir's)."""
    from stepmill.tags import proxy_url

    url = proxy_url(host, port, trajectory, group, secret)
    return {
        "HTTPS_PROXY": url,
        "HTTP_PROXY": url,
        "https_proxy": url,
        "http_proxy": url,
        "NODE_USE_ENV_PROXY": "1",  # Node's built-in fetch honours HTTPS_PROXY only with this
        **trust_env(bundle or str(ensure_bundle(confdir))),
    }
