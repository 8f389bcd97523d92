"""What this peer runs on, and how large a generation batch fits in the memory it finds."""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Hardware:
    device: str  # "cuda" or "cpu"
    name: str
    memory_bytes: int  # free GPU memory, or available host memory
    cpus: int

    def describe(self) -> str:
        return f"{self.name}, {self.memory_bytes / 2**30:.1f} GiB free, {self.cpus} CPU"


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def detect(prefer: str = "auto") -> Hardware:
    """CUDA GPU 0 if there is one (and ``prefer`` allows), else the CPU."""
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if prefer in ("auto", "cuda") and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(0)
        return Hardware("cuda", torch.cuda.get_device_name(0), int(free), cpus)
    if prefer == "cuda":
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA GPU")
    return Hardware("cpu", f"cpu x{cpus}", _host_available_bytes(), cpus)


def rows_that_fit(hw: Hardware, config, seq_len: int, dtype_bytes: int = 4, share: float = 0.5) -> int:
    """Generation rows whose KV cache and logits fit in ``share`` of the free memory (at least 1).

    Per row: K and V for every layer and position, plus one step's logits over the vocabulary (float32).
    The model's own weights are already resident, so they are not counted again.
    """
    layers = getattr(config, "num_hidden_layers", 12)
    kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 12)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_row = 2 * layers * kv_heads * head_dim * seq_len * dtype_bytes + config.vocab_size * 4 * 2
    return max(1, int(hw.memory_bytes * share // max(1, per_row)))
