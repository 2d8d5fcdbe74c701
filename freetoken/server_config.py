"""`ServerConfig`: where the server listens and what it lets through (config_tree.py's markers)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import msgspec

from freetoken.config_tree import DIAGNOSTICS, cli_flag, no_flag
from freetoken.errors import FreetokenError

_SECURITY = "cli_args.add_server_arguments (a flag, its file, or the environment)"


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: Annotated[str, cli_flag(
        "--host", "the address to listen on (default: loopback only; 0.0.0.0 for every interface)")] = "127.0.0.1"
    port: Annotated[int, cli_flag("--port")] = 8000
    # Required on every route but /health when set ("Authorization: Bearer <key>" or "x-api-key").
    api_key: Annotated[str | None, no_flag(_SECURITY)] = None
    # POST /v1/cache/resize changes what every client gets: with a token it needs
    # "Authorization: Bearer <token>" (which also passes for the API key); without one it is open
    # only on a loopback address, to requests whose Host is a loopback name (DNS rebinding).
    admin_token: Annotated[str | None, no_flag(_SECURITY)] = None
    # Origins whose web pages may call the APIs (CORS); none by default, so browsers refuse.
    allow_origins: Annotated[tuple[str, ...], no_flag("cli_args.add_server_arguments (--allow-origin)")] = ()
    # Request bodies above this get a 413 (a long agent context with its tools runs to a few MiB).
    max_request_bytes: Annotated[int, no_flag("library callers")] = 32 << 20
    # bodies nesting arrays/objects deeper get a 400
    max_json_depth: Annotated[int, no_flag("library callers")] = 64
    # a request line and headers must arrive within this
    header_timeout_s: Annotated[float, no_flag("library callers")] = 10.0
    # a body must arrive within this (408)
    body_timeout_s: Annotated[float, no_flag("library callers")] = 30.0
    # an idle keep-alive connection is closed after this
    keep_alive_s: Annotated[float, no_flag("library callers")] = 5.0
    log_format: Annotated[Literal["text", "json"], cli_flag(
        "--log-format", "the access log's lines (one per request, on stderr): text, or JSON",
        group=DIAGNOSTICS)] = "text"

    def __repr__(self) -> str:  # the secrets stay out of logs
        fields = {f: getattr(self, f) for f in self.__struct_fields__}
        for secret in ("api_key", "admin_token"):
            if fields[secret] is not None:
                fields[secret] = "<set>"
        return f"ServerConfig({', '.join(f'{k}={v!r}' for k, v in fields.items())})"

    API_KEY_ENV: ClassVar[str] = "FREETOKEN_API_KEY"
    ADMIN_TOKEN_ENV: ClassVar[str] = "FREETOKEN_ADMIN_TOKEN"

    @staticmethod
    def secret(value: str | None, file: str | None, env: str, flag: str) -> str | None:
        """A secret from its flag, else its file (`--<flag>-file`), else the environment variable `env`.

        A file keeps the secret out of `ps`; its surrounding whitespace (a final newline) is dropped."""
        if value is not None and file is not None:
            raise FreetokenError(f"give --{flag} or --{flag}-file, not both")
        if file is not None:
            try:
                value = Path(file).read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise FreetokenError(f"--{flag}-file {file}: cannot read it: {exc}") from None
            if not value:
                raise FreetokenError(f"--{flag}-file {file}: the file is empty")
            return value
        if value is None:
            value = os.environ.get(env) or None
        if value is not None and not value.strip():
            raise FreetokenError(f"--{flag}: the value is empty")
        return value
