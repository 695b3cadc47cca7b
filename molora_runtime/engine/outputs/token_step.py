"""What a step that emits tokens needs: the stop ids, the hot-set (attribution), the scheduler
(freeing finished sequences), gate summaries, incremental text and the endings. Sampling and
speculative verification both emit tokens, so both start from it."""

from __future__ import annotations

from molora_runtime.engine.outputs.endings import Endings
from molora_runtime.engine.outputs.text_stream import TextStream
from molora_runtime.engine.route_stats.gate_summary import GateSummaries
from molora_runtime.engine.scheduling.scheduler import Scheduler
from molora_runtime.lora.hotset import HotSet


class TokenStep:
    """The parts a token-emitting step of the output processor shares."""

    def __init__(
        self,
        eos_ids: set[int],
        hot_set: HotSet,
        scheduler: Scheduler,
        summaries: GateSummaries,
        text: TextStream,
        endings: Endings,
    ) -> None:
        self.eos_ids = eos_ids
        self.hot_set = hot_set
        self.scheduler = scheduler
        self.summaries = summaries
        self.text = text
        self.endings = endings
