"""The floor of a run: the least time this machine could take for the work the engine actually did.

Each step's work is what ``Engine.work_log`` recorded (``StepWork``). The step's floor is the larger of two
times. The first is its arithmetic at the measured matmul peaks: every layer's linears once per query row (at the
int8 peak in ``int8-w8a8``, whose linears multiply int8 codes; at the model dtype's otherwise), the LM head once
per sampled row (at the int8 peak in ``int8-w8a8-head``), QK^T and PV once per (query row, key) pair. The second
is its bytes at the measured memory bandwidth: the weights as the mode stores them, read once per step whatever
the batch, and the K/V of every context position read. The run's floor is the sum over its steps.

A run at 62% of its floor took 1 / 0.62 times the least time this work could take here. Its schedule (how many
steps, how the tokens were grouped) is kvlab's own; another schedule of the same tokens has another floor, which
is why a peer whose steps are not observable gets none.

This is the one cost model of the benchmarks: ``kvlab bench step``'s and ``bench scaling``'s rooflines are the
floors of the steps they time, priced here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvlab.engine.engine import Engine
from kvlab.engine.stats import StepWork
from kvlab.model.packed import PackedLinear
from kvlab.model.quant import Int4Linear, Int8Linear, W8A8Linear, head_dtype, linear_dtype


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the linear weights a step streams once (whatever the batch), as the model stores them: a
    prepacked copy instead of its original, quantised codes and their scales (``weight_nbytes``)."""
    total = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            total += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, PackedLinear | Int8Linear | Int4Linear | W8A8Linear):
            total += m.weight_nbytes()
    return total


@dataclass(frozen=True)
class Machine:
    """This machine's measured limits (``step.matmul_peaks``, ``step.memory_bandwidth``)."""

    peak_gflops: dict[str, float]  # dtype name ("float32", "bfloat16", "int8") -> matmul GFLOP/s (int8: GOP/s)
    bandwidth_gbps: float

    def summary(self) -> str:
        """The limits as a table title states them: a floor share is read against the limits it was priced at
        (this VM's memory reads 34 or 58 GB/s minutes apart)."""
        peaks = ", ".join(f"{d} {g:.1f} {'GOP' if d == 'int8' else 'GFLOP'}/s" for d, g in self.peak_gflops.items())
        return f"matmul peak {peaks}; memory {self.bandwidth_gbps:.1f} GB/s"

    def as_dict(self) -> dict[str, object]:
        return {"matmul_peak_gflops": dict(self.peak_gflops), "memory_gbps": self.bandwidth_gbps}


@dataclass(frozen=True)
class WorkCosts:
    """What each unit of ``StepWork`` costs for one model in one mode."""

    dtype: str  # the dtype whose matmul peak attention (and an LM head in the model's dtype) runs at: the model's
    linear_dtype: str  # the one the layers' linears run at: "int8" in int8-w8a8, else the model's
    head_dtype: str  # the LM head's: "int8" in int8-w8a8-head, else the model's
    linear_flops_per_row: float  # 2 x the parameters of every layer's linears (the LM head apart)
    head_flops_per_row: float  # 2 x hidden x vocabulary
    attention_flops_per_pair: float  # QK^T and PV: 4 x layers x heads x head_dim
    weight_bytes: int  # the linears as the mode stores them (packed copies, quantised codes and scales)
    kv_bytes_per_position: int  # K and V of every layer

    @classmethod
    def of(cls, engine: Engine) -> WorkCosts:
        cfg = engine.loaded.config
        reference = engine.loaded.model
        linear = sum(m.weight.numel() for m in reference.modules() if isinstance(m, torch.nn.Linear))
        head = cfg.hidden_size * cfg.vocab_size
        storage = engine.storage
        dtype = str(engine.model.dtype).removeprefix("torch.")
        return cls(
            dtype=dtype,
            linear_dtype=linear_dtype(engine.mode.quantization, dtype),
            head_dtype=head_dtype(engine.mode.quantization, dtype),
            linear_flops_per_row=2.0 * (linear - head),
            head_flops_per_row=2.0 * head,
            attention_flops_per_pair=4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim,
            weight_bytes=weight_bytes(engine.model),
            kv_bytes_per_position=storage.block_nbytes // storage.block_size,
        )

    def parts(self, work: StepWork) -> tuple[tuple[str, float], ...]:
        """The step's arithmetic, part by part, each with the dtype whose peak it runs at: its linears, LM head
        and attention."""
        return (
            (self.linear_dtype, self.linear_flops_per_row * work.query_tokens),
            (self.head_dtype, self.head_flops_per_row * work.sampled_rows),
            (self.dtype, self.attention_flops_per_pair * work.attention_pairs),
        )

    def flops(self, work: StepWork) -> float:
        """The step's arithmetic, whatever peak each part runs at."""
        return sum(f for _, f in self.parts(work))

    def bytes_read(self, work: StepWork) -> int:
        """What the step reads from memory at the least: the weights once, and the K/V of every context position."""
        return self.weight_bytes + self.kv_bytes_per_position * work.context_tokens

    def bounds_s(self, work: StepWork, machine: Machine) -> tuple[float, float]:
        """(arithmetic, memory): the step's arithmetic at the measured peaks (each part at its dtype's), and its
        bytes at the measured bandwidth, in seconds."""
        arithmetic = sum(f / machine.peak_gflops[dtype] for dtype, f in self.parts(work)) / 1e9
        return arithmetic, self.bytes_read(work) / (machine.bandwidth_gbps * 1e9)

    def step_floor_s(self, work: StepWork, machine: Machine) -> float:
        """The larger bound of one step."""
        return max(self.bounds_s(work, machine))

    def floor_s(self, steps: Sequence[StepWork], machine: Machine) -> float:
        """The run's floor: the sum of its steps'."""
        return sum(self.step_floor_s(w, machine) for w in steps)
