"""Patches around a vLLM engine's start and shutdown in this process: Python's garbage collector paused or its full
collections skipped (vLLM's start and shutdown walk the whole heap), the start-up mark `warming` made when vLLM
starts warming up, and CPU layers given torch's linear as their kernel (`rollout.cpu_linear`).
Does not own: the engine, its settings or when a patch applies (`actors.engine`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

from sync.startup import mark


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused, and everything already alive frozen (left out of its collections),
    while vLLM starts: importing it and building an engine allocate millions of objects, each automatic collection a
    walk over them (vLLM's own five `gc.collect()` calls are no-ops on CPU: `VllmEngine._start`). The collector runs
    again afterwards; the heap stays frozen, as vLLM's engine core leaves it at the end of its start
    (`freeze_gc_heap`) and unfreezes it in its own shutdown. Only a start that fails unfreezes it here."""
    if not gc.isenabled():  # paused by someone else: theirs to resume
        yield
        return
    gc.freeze()
    gc.disable()
    try:
        yield
    except BaseException:
        gc.unfreeze()
        raise
    finally:
        gc.enable()


@contextlib.contextmanager
def no_full_collections() -> Iterator[None]:
    """`gc.collect()` a no-op: vLLM's engine-core shutdown collects twice (0.85 s of a worker's 0.9 s shutdown on
    this CPU, mostly walking torch's and vLLM's modules), to hand GPU memory back at once. A CPU engine's memory goes
    back when its objects die (cycles at the next automatic collection), or with its process, which a stopped worker's
    is about to be."""
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect


@contextlib.contextmanager
def warm_up_marked() -> Iterator[None]:
    """While an engine starts in this process: its start-up mark `warming` (sync/startup.py) is made when vLLM has
    loaded the model and starts profiling it, sizing the KV cache and warming up (`EngineCore._initialize_kv_caches`),
    so the console and `time/startup/*` tell the model's load from the warm-up."""
    from vllm.v1.engine.core import EngineCore

    initialize = EngineCore._initialize_kv_caches

    def marked(core: Any, *args: Any, **kwargs: Any) -> Any:
        mark("warming")
        return initialize(core, *args, **kwargs)

    EngineCore._initialize_kv_caches = marked
    try:
        yield
    finally:
        EngineCore._initialize_kv_caches = initialize


@contextlib.contextmanager
def torch_linear_kernels() -> Iterator[None]:
    """While an engine starts: vLLM's CPU layers with 2-D weights take `torch_linear` as their kernel, on their
    weights as loaded, instead of the oneDNN (or AMX) kernel vLLM would build from a packed copy. vLLM looks its
    dispatcher up when it processes the loaded weights; it is restored after, so engines started later in this
    process pick for themselves."""
    from vllm.model_executor.layers import utils

    from actors.vllm_extension import torch_linear_dispatch

    vllm_dispatch = utils.dispatch_cpu_unquantized_gemm
    utils.dispatch_cpu_unquantized_gemm = torch_linear_dispatch(vllm_dispatch)
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = vllm_dispatch
