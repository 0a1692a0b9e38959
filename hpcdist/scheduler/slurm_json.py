"""What ``scontrol --json`` prints, read into the same facts as its text (``slurm_text``).

Releases since 23.02 print their nodes as JSON (``scontrol --json show node``; Debian's 22.05
answers "unrecognized option"), the form made for programs: a ``Reason`` that holds ``Gres=...``,
an ``OS`` with spaces, a state of several flags are fields of their own there, not text to split.
Each node's JSON is mapped onto ``scontrol -o show node``'s names (``node_fields``) and read by
the one reader of a node (``slurm_text.node_of``, through ``slurm_text.nodes_json``), so both
forms give the same ``Node``.

Partitions stay on text: 24.11's JSON (data_parser v0.0.42) carries no ``Default`` and no
``Hidden`` of a partition, which discovery needs (tests/fixtures/slurm/24.11-r2411). Standard
library only.
"""

from __future__ import annotations

import json
from typing import Any

# a node's JSON field -> scontrol -o show node's name for it
_FIELDS = {"name": "NodeName", "cpus": "CPUTot", "effective_cpus": "CPUEfctv", "specialized_cores": "CoreSpecCount",
           "threads": "ThreadsPerCore", "real_memory": "RealMemory", "specialized_memory": "MemSpecLimit",
           "gres": "Gres", "features": "AvailableFeatures", "partitions": "Partitions", "state": "State"}
_JOINED = {"features": ",", "partitions": ",", "state": "+"}  # lists in the JSON, one string in the text


def _value(key: str, value: Any) -> str | None:
    """One JSON value as scontrol's text writes it; None for a number Slurm marks unset."""
    if isinstance(value, dict):  # {"set": true, "infinite": false, "number": 4}
        return str(value["number"]) if value.get("set") and not value.get("infinite") else None
    if isinstance(value, list):
        return _JOINED.get(key, ",").join(str(v) for v in value)
    return None if value is None else str(value)


def node_fields(out: str) -> list[dict[str, str]] | None:
    """``scontrol --json show node``'s nodes, each by the text's names (``CPUTot``, ``Gres``,
    ``State``: ``IDLE+DRAIN``); None where `out` is not such JSON (a release without ``--json``
    prints its usage): the text is read then."""
    try:
        return [{text: v for key, text in _FIELDS.items() if (v := _value(key, row.get(key))) is not None}
                for row in json.loads(out)["nodes"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
