"""Alarms sent where people watch a run: one trackio alert and one W&B alert per alarm episode, for the trackers
that `report_to` names, at the log step the `AnomalyMonitor` opens it. A tracker without a run is skipped; one that
fails is named once in a warning, and training goes on.
"""

from __future__ import annotations

from transformers import TrainerCallback
from transformers.utils import logging

from ..guardrails.anomaly import AnomalyMonitor

__all__ = ["ALERT_TRACKERS", "TrackerAlerts", "alert_title"]

logger = logging.get_logger(__name__)

#: The `report_to` loggers that take alerts.
ALERT_TRACKERS = ("trackio", "wandb")


def alert_title(name: str) -> str:
    """The alert's title: one per alarm (W&B throttles a title's repeats), under W&B's limit of 64 characters."""
    return f"GRPO alarm: {name}"[:63]


def _send_trackio(title: str, text: str) -> bool:
    import trackio

    if trackio.context_vars.current_run.get() is None:
        return False
    trackio.alert(title=title, text=text, level=trackio.AlertLevel.WARN)
    return True


def _send_wandb(title: str, text: str) -> bool:
    import wandb

    if wandb.run is None:
        return False
    wandb.run.alert(title=title, text=text, level=wandb.AlertLevel.WARN)
    return True


_SENDERS = {"trackio": _send_trackio, "wandb": _send_wandb}


class TrackerAlerts(TrainerCallback):
    """Send each alarm episode that `monitor` opens to the trackers of `report_to` that take alerts (main process).

    Args:
        monitor (`AnomalyMonitor`): the callback that judges the alarms; it runs before this one.
    """

    def __init__(self, monitor):
        self.monitor = monitor
        self._sent = 0  # episodes of `monitor.episodes` already handled
        self._failed: set[str] = set()

    @classmethod
    def install(cls, trainer) -> TrackerAlerts | None:
        """Add a `TrackerAlerts` for `trainer`'s `AnomalyMonitor` (none without one), after the loggers: a trackio
        alert is filed at the step of the metrics just logged."""
        monitor = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, AnomalyMonitor)), None)
        if monitor is None:
            return None
        alerts = cls(monitor)
        trainer.add_callback(alerts)
        return alerts

    def on_train_begin(self, args, state, control, **kwargs):
        # A resumed run: the monitor replayed the episodes already given; they were sent by the run that gave them.
        self._sent = len(self.monitor.episodes)

    def on_log(self, args, state, control, logs=None, **kwargs):
        episodes = self.monitor.episodes[self._sent :]
        self._sent = len(self.monitor.episodes)
        if not episodes or not state.is_world_process_zero:
            return
        trackers = [name for name in ALERT_TRACKERS if name in (args.report_to or [])]
        for episode in episodes:
            text = f"Step {episode.start}: {episode.message}"
            for name in trackers:
                self._send(name, alert_title(episode.name), text)

    def _send(self, tracker: str, title: str, text: str) -> None:
        try:
            _SENDERS[tracker](title, text)
        except Exception as error:  # an alert must never stop training
            if tracker not in self._failed:
                self._failed.add(tracker)
                logger.warning(f"Could not send the alarm to {tracker} as an alert ({type(error).__name__}: {error}).")
