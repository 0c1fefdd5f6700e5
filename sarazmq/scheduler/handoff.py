"""The scheduler's calls for a disaggregated deployment (`transfers` has the protocol).

A mixin of `Scheduler`: a prefill instance parks each request after its first token and
hands it off; a decode instance takes handed-off requests in and pulls their KV. Kept
apart from the iteration (`scheduler`) because a co-located instance never calls it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from sarazmq.protocol.common import FINISH_ERROR, FINISH_LENGTH
from sarazmq.protocol.worker import BatchPlan, KVPull
from sarazmq.sampling_params import SamplingParams
from sarazmq.scheduler.request import Request, RequestStatus
from sarazmq.scheduler.transfers import KVParking, KVPulls, KVSource
from sarazmq.validation import InvalidRequestError


class DisaggregationMixin:
    """`Scheduler`'s disaggregation calls; the attributes below are the scheduler's."""

    waiting: deque[Request]
    running: list[Request]
    parking: KVParking
    pulls: KVPulls
    _requests: dict[str, Request]
    _pending_freed: list[int]
    _calibration_seq_ids: set[int]
    _watermark_blocks: int

    # the scheduler's own calls (`Scheduler.add_request`, `Scheduler._finish`)
    add_request: Callable[..., None]
    _finish: Callable[..., None]

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        first_token: int,
        first_token_time: float,
        first_scheduled_time: float,
        arrival_time: float,
        source: KVSource | None = None,
    ) -> None:
        """Queues a request whose prompt another instance computed (the decode side of a
        disaggregated deployment): the prompt's KV arrives by transfer and its first output
        token is known. Admitted, its blocks hold the sent KV, and its first step computes
        the first output token's KV and samples the second; preempted, it recomputes the
        prompt here (the KV is not asked for again). InvalidRequestError as add_request,
        and when the request has no output left to make.

        source: where its KV is (a decode instance of a deployment): it waits for blocks,
        then its workers pull the KV (`start_pulls`, `kv_pulled`) before it can run.
        Without one (the simulator) the KV is taken to be here already."""
        self.add_request(request_id, prompt_token_ids, params, arrival_time)
        req = self._requests[request_id]
        if req.max_output_tokens < 2:
            self._requests.pop(request_id)
            self.waiting.remove(req)
            raise InvalidRequestError(
                f"request {request_id!r} is done after its first token (max_tokens "
                f"{params.max_tokens}): nothing is left to decode",
                "max_tokens",
            )
        req.output_token_ids.append(first_token)
        req.token_times.append(first_token_time)
        req.first_scheduled_time = first_scheduled_time
        req.num_transferred_tokens = len(req.prompt_token_ids)
        if source is not None:
            self.waiting.remove(req)
            self.pulls.add(req, source)

    def start_pulls(self) -> list[KVPull]:
        """Gives blocks to the arrived requests that fit and returns the pulls to send to
        every worker (`transfers.KVPulls.start`)."""
        self.pulls.start(self._watermark_blocks if self.running else 0)
        return self.pulls.take_pulls()

    def kv_pulled(
        self, seq_id: int, rank: int, error: str, nbytes: int = 0, seconds: float = 0.0
    ) -> tuple[Request, KVSource, str] | None:
        """One worker's report of a pull. Once every rank has reported: the request, its
        source and the pull's error (""; "cancelled" for an aborted request). Its KV in
        place, the request waits for admission with its blocks; otherwise it is finished
        (the caller reports the error)."""
        done = self.pulls.pulled(seq_id, rank, error, nbytes, seconds)
        if done is None:
            return None
        req, source, err = done
        if err == "cancelled":
            return done
        if err:
            self._finish(req, FINISH_ERROR)
            return done
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        return done

    def source_down(self, instance: int) -> list[Request]:
        """Prefill instance `instance` died: the requests whose KV was to come from it are
        finished (with an error: the caller reports it); blocks a pull writes into stay
        until its ranks report. Returns them."""
        failed = self.pulls.from_source(instance)
        for req in failed:
            self._finish(req, FINISH_ERROR)
        return failed

    def take_handoffs(self) -> list[Request]:
        """A prefill instance's requests parked since the last call (their first token
        out, their KV kept): to hand off to a decode instance."""
        return self.parking.take_handoffs()

    def release_parked(self, request_id: str) -> bool:
        """Frees a parked request's blocks (its KV was pulled, or is no longer needed);
        False if it is not parked here."""
        req = self.parking.parked.get(request_id)
        if req is None:
            return False
        self._finish(req, FINISH_LENGTH)  # counted finished here: its part is done
        return True

    def _park_first_tokens(self, plan: BatchPlan) -> None:
        """A prefill instance: each request that just sampled its first token and goes on
        leaves the running requests with its blocks (`transfers.KVParking`)."""
        reqs = self._requests
        parked = False
        for s in plan.scheduled:
            if not s.sample:
                continue
            req = next((r for r in self.running if r.seq_id == s.seq_id), None)
            if req is None or req.num_output_tokens != 1 or req.request_id not in reqs:
                continue
            if self._calibration_seq_ids and req.seq_id in self._calibration_seq_ids:
                continue
            req.status = RequestStatus.PARKED
            parked = True
            if req.on_worker:
                self._pending_freed.append(req.seq_id)
                req.on_worker = False
            self.parking.park(req)
        if parked:
            self.running[:] = [r for r in self.running if r.status is RequestStatus.RUNNING]
