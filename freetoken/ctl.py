"""`python -m freetoken ctl`: inspect and resize the caches of a running server.

    freetoken ctl status [--url URL]                      health, model and cache split
    freetoken ctl cache  [--url URL]                      the cache split (GET /v1/cache/status)
    freetoken ctl cache  --moe 48 --kv 32k [--url URL]    resize (POST /v1/cache/resize)

Sizes are positive integers, optionally with a binary suffix: k = 1024, m = 1024 * 1024
(so `--kv 32k` is 32768 tokens). Results are printed to stdout as JSON; errors (server down,
a size the engine refuses) go to stderr with the server's message, and the exit status is 1.

Credentials, for a server started with them: `--api-key` (or $FREETOKEN_API_KEY) for every
request, `--admin-token` (or $FREETOKEN_ADMIN_TOKEN) for a resize; the admin token alone also
passes for the API key. The environment keeps them out of `ps`.

Standard library only: this runs next to a server without loading torch or the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
# The variables `serve` reads too (config.ServerConfig); this module stays standard-library only.
API_KEY_ENV = "FREETOKEN_API_KEY"
ADMIN_TOKEN_ENV = "FREETOKEN_ADMIN_TOKEN"
DEFAULT_TIMEOUT_S = 120.0  # a resize waits for a safe point between engine steps
_SUFFIXES = {"k": 1 << 10, "m": 1 << 20}


class CtlError(Exception):
    """A request to the server failed; the message says why (the server's own words if it answered).

    status and body: the HTTP status and the decoded JSON body when the server answered with an error."""

    def __init__(self, message: str, status: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def parse_size(text: str) -> int:
    """A positive size: "4096", "32k" (32768), "1.5k" (1536), "1m" (1048576)."""
    s = text.strip().lower().replace("_", "")
    scale = 1
    if s[-1:] in _SUFFIXES:
        scale, s = _SUFFIXES[s[-1]], s[:-1]
    try:
        value = int(s) * scale if "." not in s else float(s) * scale
        ok = value == int(value) and value > 0
    except (ValueError, OverflowError):
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give a positive integer, optionally with k (x1024) or m (x1024^2)"
        )
    return int(value)


def base_url(url: str) -> str:
    """The server's root URL: a scheme is added if missing, a trailing /v1 (the OpenAI base URL) dropped."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def request(
    url: str, method: str, path: str, body: Any = None, timeout: float = DEFAULT_TIMEOUT_S, token: str | None = None
) -> Any:
    """Send one JSON request to the server at `url`; its decoded JSON answer, or CtlError."""
    root = base_url(url)
    data = None if body is None else json.dumps(body).encode()
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if data is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(root + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        message = _server_message(body, raw) or exc.reason
        raise CtlError(f"{method} {path}: HTTP {exc.code}: {message}", exc.code, body) from None
    except urllib.error.URLError as exc:
        raise CtlError(f"cannot reach the server at {root}: {exc.reason}") from None
    except TimeoutError:
        raise CtlError(f"{method} {path}: no answer from {root} within {timeout:g} s") from None
    except OSError as exc:
        raise CtlError(f"{method} {path}: the connection to {root} failed: {exc}") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise CtlError(f"{method} {path}: the answer from {root} is not JSON: {raw[:200]!r}") from None


def _server_message(body: Any, raw: bytes) -> str | None:
    if body is None:
        return raw.decode("utf-8", errors="replace").strip()[:500] or None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return json.dumps(body)[:500]


def status(url: str, timeout: float = DEFAULT_TIMEOUT_S, token: str | None = None) -> dict[str, Any]:
    """{"server", "health", "model", "cache"}: what `ctl status` prints (`token`: the API key)."""
    try:
        health = request(url, "GET", "/health", timeout=timeout)
    except CtlError as exc:
        if exc.status != 503 or not isinstance(exc.body, dict):
            raise
        health = exc.body  # unhealthy, and says why
    models = request(url, "GET", "/v1/models", timeout=timeout, token=token)
    data = models.get("data") if isinstance(models, dict) else None
    model = data[0] if isinstance(data, list) and len(data) == 1 else data
    cache = request(url, "GET", "/v1/cache/status", timeout=timeout, token=token)
    return {"server": base_url(url), "health": health, "model": model, "cache": cache}


def cache(
    url: str, moe_slots: int | None = None, kv_tokens: int | None = None, timeout: float = DEFAULT_TIMEOUT_S,
    token: str | None = None,
) -> dict[str, Any]:
    """The cache status; with a size, resize first (the answer is then the new status).

    token: sent as the bearer token (the admin token for a resize, or the API key)."""
    if moe_slots is None and kv_tokens is None:
        return request(url, "GET", "/v1/cache/status", timeout=timeout, token=token)
    body = {"moe_slots": moe_slots, "kv_tokens": kv_tokens}
    return request(url, "POST", "/v1/cache/resize", body, timeout=timeout, token=token)


def add_ctl_arguments(parser: argparse.ArgumentParser) -> None:
    """The `ctl` subcommands (status, cache) and their options, on `parser`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=DEFAULT_URL, help=f"the server (default: {DEFAULT_URL})")
    common.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for an answer")
    common.add_argument("--api-key", default=None,
                        help=f"the server's --api-key, if it was started with one (default: ${API_KEY_ENV})")
    sub = parser.add_subparsers(dest="ctl_command", required=True)
    sub.add_parser("status", parents=[common], help="the server's health, model and cache split")
    c = sub.add_parser(
        "cache",
        parents=[common],
        help="show the cache split, or resize it",
        description="Without --moe/--kv, print the cache status; with them, resize the caches and print "
        "the new status. Sizes take a k (x1024) or m (x1024^2) suffix: --kv 32k is 32768 tokens.",
    )
    c.add_argument("--moe", type=parse_size, default=None, metavar="N", help="GPU expert slots")
    c.add_argument("--kv", type=parse_size, default=None, metavar="N", help="KV cache tokens (e.g. 32k = 32768)")
    c.add_argument("--admin-token", "--token", dest="admin_token", default=None,
                   help=f"the server's --admin-token, if it was started with one (default: ${ADMIN_TOKEN_ENV})")


def credential(args: argparse.Namespace) -> str | None:
    """The bearer token to send: the admin token when one is given (it passes for the API key too),
    else the API key; each from its flag, else its environment variable."""
    admin = getattr(args, "admin_token", None) or os.environ.get(ADMIN_TOKEN_ENV)
    return admin or args.api_key or os.environ.get(API_KEY_ENV) or None


def run_ctl(args: argparse.Namespace) -> int:
    token = credential(args)
    try:
        if args.ctl_command == "status":
            result = status(args.url, timeout=args.timeout, token=token)
        else:
            result = cache(args.url, args.moe, args.kv, timeout=args.timeout, token=token)
    except CtlError as exc:
        print(f"freetoken ctl: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    if args.ctl_command == "status" and isinstance(result["health"], dict):
        return 0 if result["health"].get("status") == "ok" else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="freetoken ctl", description="Inspect and resize a running server.")
    add_ctl_arguments(parser)
    return run_ctl(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
