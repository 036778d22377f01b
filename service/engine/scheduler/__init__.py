"""The scheduler and its managers (see scheduler.py)."""

from service.engine.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
