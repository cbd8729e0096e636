"""Background threads of the kit: each a named daemon, so a stuck one never keeps the process
alive and a stack dump says which it is."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def start_daemon(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """Start ``target(*args)`` on a daemon thread called ``name``; returns the thread."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread
