"""Hostile probe attacks on the network rule (`network = false`: nothing outside the
sandbox), kept apart from attacks.py so they can grow on their own; merged into
attacks.ATTACKS."""
from __future__ import annotations

from typing import Callable

from supervisor.worker import WorkerContext

ATTACKS: dict[str, Callable[[WorkerContext], dict]] = {}
