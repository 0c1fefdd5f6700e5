"""CUDA graphs for decode-only steps: one captured forward pass per padded batch size.

A decode step of a large model on a GPU launches a few hundred small kernels (norms,
rotary, matmuls of a few rows, attention) whose launch costs more than their work at
small batches. As vLLM and SGLang do, the forward pass of a decode-only batch is captured
once per batch size of a ladder (1, 2, 4, then multiples of 8 up to a maximum) and
replayed: the batch is padded to the next size of the ladder, its inputs copied into the
static buffers the graph reads, the graph replayed, the real rows of its output kept.

Padding rows are harmless by construction: their cache slot is -1 (the KV write skips
it), their KV length 1 over block 0 (attention reads one key there, finite), their token
0; each row of the model is computed independently of the others, so the real rows'
results are those of an unpadded batch.

Captured only where the attention backend says its decode path reads nothing but the
metadata's tensors (`cuda_graph_safe`: the Triton backend), with one worker per model
(no tensor-parallel all-reduce, no pipeline stages). Every size is captured at startup
(`capture_all`, largest first so the smaller ones reuse its memory pool), on batches of
padding rows only, which write no KV: a size first met while serving would otherwise
stall that step by its capture. `capture=False` runs the same padded static buffers
eagerly, which is how the padding is tested without a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sarazmq.kernels.metadata import AttentionMetadata

#: the cache slot of a padding row: the KV write skips negative slots
PAD_SLOT = -1


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, then every multiple of 8 up to
    `max_batch` (vLLM's ladder), and `max_batch` itself. ValueError when it is < 1."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch} must be >= 1")
    sizes = [s for s in (1, 2, 4) if s <= max_batch]
    sizes += list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


@dataclass
class _Captured:
    """One batch size's graph (None when running eagerly) and its output buffer."""

    graph: torch.cuda.CUDAGraph | None
    out: torch.Tensor  # [size, hidden]
    meta: AttentionMetadata


class DecodeGraphs:
    """Runs decode-only batches of up to `max_batch` sequences through captured graphs.

    model: the whole model (one stage, one rank); kv_caches: its per-layer caches;
    max_blocks: the longest block table a sequence can have (max_model_len / block size).
    Graphs are captured by `capture_all`, or else the first time a size is needed.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_batch: int,
        max_blocks: int,
        device: torch.device,
        *,
        capture: bool = True,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks={max_blocks} must be >= 1")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks
        self.device = device
        self.capture = capture
        self._graphs: dict[int, _Captured] = {}
        #: seconds `capture_all` took (0 before it ran)
        self.capture_seconds = 0.0
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        b = self.max_batch
        # static inputs the graphs read: [ids, positions, slots] int64 and [seq lens,
        # cu_seqlens_q (fixed), block tables] int32
        self._long = torch.zeros(3, b, dtype=torch.int64, device=device)
        self._lens = torch.ones(b, dtype=torch.int32, device=device)
        self._cu = torch.arange(b + 1, dtype=torch.int32, device=device)
        self._tables = torch.zeros(b, max_blocks, dtype=torch.int32, device=device)
        # host staging (pinned on CUDA, so the copies to the device are asynchronous)
        pin = device.type == "cuda"
        self._host_long = torch.zeros(3, b, dtype=torch.int64, pin_memory=pin)
        self._host_int = torch.zeros(b * (1 + max_blocks), dtype=torch.int32, pin_memory=pin)

    def takes(self, num_seqs: int, longest_table: int) -> bool:
        """Whether a decode-only batch of `num_seqs` sequences, the longest block table
        `longest_table` blocks, runs here."""
        return 0 < num_seqs <= self.max_batch and longest_table <= self.max_blocks

    def padded_size(self, num_seqs: int) -> int:
        """The captured size a batch of `num_seqs` decodes runs at."""
        return next(s for s in self.sizes if s >= num_seqs)

    @property
    def captured_sizes(self) -> list[int]:
        """The sizes captured so far (or, eagerly, set up so far), ascending."""
        return sorted(self._graphs)

    def run(self, input_ids: list[int], k_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        """The final hidden states [B, hidden] of B decodes: token `input_ids[i]` at
        position k_lens[i] - 1 of a sequence whose blocks are tables[i]. ValueError when
        the batch does not fit (`takes`)."""
        n = len(input_ids)
        longest = max((len(t) for t in tables), default=0)
        if not (n == len(k_lens) == len(tables)) or not self.takes(n, longest):
            raise ValueError(
                f"decode graphs take 1..{self.max_batch} sequences of at most "
                f"{self.max_blocks} blocks; got {n} ids, {len(k_lens)} lengths, "
                f"{len(tables)} tables (longest {longest} blocks)"
            )
        size = self.padded_size(n)
        self._stage(input_ids, k_lens, tables, size)
        captured = self._graphs.get(size)
        if captured is None:
            captured = self._graphs[size] = self._setup(size)
        elif captured.graph is None:
            self._forward(size, captured.meta, out=captured.out)
        else:
            captured.graph.replay()
        return captured.out[:n]

    def capture_all(self) -> float:
        """Captures every size's graph (largest first) on batches of padding rows, which
        write no KV; returns the seconds it took (`capture_seconds`). Sizes set up
        already are skipped."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                if size not in self._graphs:
                    self._stage([], [], [], size)
                    self._graphs[size] = self._setup(size)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - t0
        return self.capture_seconds

    def _stage(
        self, input_ids: list[int], k_lens: list[int], tables: list[list[int]], size: int
    ) -> None:
        """Writes the batch, padded to `size`, into the static inputs. Block tables are
        written only up to the batch's longest (the kernels read no column past a
        sequence's length, so what older steps left further right is never read): per
        step that is the batch's blocks, not `max_blocks` (max_model_len / block size)
        for every row."""
        n, bs = len(input_ids), self.block_size
        w = max((len(t) for t in tables), default=1)  # padding rows read column 0
        pad = size - n
        pos = [k - 1 for k in k_lens]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos, strict=True)]
        host_long = self._host_long[:, :size]
        host_long[0] = torch.tensor(input_ids + [0] * pad, dtype=torch.int64)
        host_long[1] = torch.tensor(pos + [0] * pad, dtype=torch.int64)
        host_long[2] = torch.tensor(slots + [PAD_SLOT] * pad, dtype=torch.int64)
        flat: list[int] = list(k_lens) + [1] * pad
        for t in tables:
            flat.extend(t)
            flat.extend([0] * (w - len(t)))
        flat.extend([0] * (w * pad))
        host_int = self._host_int[: size * (1 + w)]
        host_int.copy_(torch.tensor(flat, dtype=torch.int32))
        # the previous step's copies were complete when its tokens were read back, so
        # the staging buffers are free to overwrite
        self._long[:, :size].copy_(host_long, non_blocking=True)
        self._lens[:size].copy_(host_int[:size], non_blocking=True)
        self._tables[:size, :w].copy_(host_int[size:].view(size, w), non_blocking=True)

    def _meta(self, size: int) -> AttentionMetadata:
        """The metadata of a padded batch of `size` decodes, views of the static inputs."""
        return AttentionMetadata(
            cu_seqlens_q=self._cu[: size + 1],
            seq_lens_k=self._lens[:size],
            block_tables=self._tables[:size],
            slot_mapping=self._long[2, :size],
            max_seqlen_q=1,
            max_seqlen_k=self.max_blocks * self.block_size,
            num_decodes=size,
            q_lens=[1] * size,
            k_lens=[self.max_blocks * self.block_size] * size,
            positions=self._long[1, :size],
        )

    def _forward(
        self, size: int, meta: AttentionMetadata, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.model(self._long[0, :size], self._long[1, :size], self.kv_caches, meta)
        if out is None:
            return hidden
        return out.copy_(hidden)

    def _setup(self, size: int) -> _Captured:
        """Runs the first batch of `size` and, on CUDA, captures its graph (after that
        warm-up run, which also compiles any Triton kernel first used here)."""
        meta = self._meta(size)
        if not self.capture:
            return _Captured(None, self._forward(size, meta).clone(), meta)
        # warm-up on a side stream, as torch.cuda.graphs asks, then the capture itself:
        # its run writes the same KV (the same slots and values) a second time
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(size, meta)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(size, meta)
        graph.replay()
        return _Captured(graph, out, meta)
