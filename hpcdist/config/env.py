"""Environment variables in a site or a job spec: names checked, values as strings, and no value
of a secret-looking name ever written (it belongs in ``env_passthrough``, taken from the shell)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BeforeValidator

# Environment variable names a site may export; anything else is almost certainly a typo.
_ENV_NAME_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


def _env_as_strings(value: object) -> object:
    """YAML turns `OMP_NUM_THREADS: 1` into an int; the environment only holds strings."""
    if isinstance(value, dict):
        return {k: v if isinstance(v, str) else _yaml_scalar(v) for k, v in value.items()}
    return value


# Words that mark a variable's value as a secret (matched against the parts of its name
# between underscores: HF_TOKEN, AWS_SECRET_ACCESS_KEY, WANDB_API_KEY, DB_PASSWORD...).
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "APIKEY")
_SECRET_PARTS = frozenset({"KEY", "PASS", "PAT"})


REDACTED = "REDACTED"  # written where a secret-looking variable's value would be


def looks_secret(name: str) -> bool:
    """Whether a variable's name says its value is a secret (then hpcdist never writes the value)."""
    parts = name.upper().split("_")
    words = any(p.removesuffix("S").endswith(w) for p in parts for w in _SECRET_WORDS)  # not TOKENIZERS_...
    return words or any(p in _SECRET_PARTS for p in parts)


def _env_name(key: str) -> str:
    if not key or not set(key) <= _ENV_NAME_CHARS or key[0].isdigit():
        raise ValueError(f"{key!r} is not a valid environment variable name")
    return key


def _env_names(value: dict[str, str]) -> dict[str, str]:
    for key in value:
        _env_name(key)
        if looks_secret(key):
            raise ValueError(
                f"{key} looks like a secret, and a value under env is written into the job script "
                f"and every result file; export {key} in the shell you submit from and list it "
                f"under the job's env_passthrough instead"
            )
    return value


# Variables to export: names checked, values as strings (shared by sites and job specs).
EnvMap = Annotated[dict[str, str], BeforeValidator(_env_as_strings), AfterValidator(_env_names)]
# Names of variables taken from the submitting shell: only the names are ever written.
EnvNames = tuple[Annotated[str, AfterValidator(_env_name)], ...]


def _yaml_scalar(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
