"""Code that runs inside vLLM's worker process: the in-place weight update of a running engine.

Owns: `RelayWorkerExtension`, mixed into vLLM's worker through `LLM(worker_extension_cls=...)` and reached with
`llm.collective_rpc("relay_...")`. Method names carry a `relay_` prefix so they never clash with worker attributes.
Does not own: where the weights come from (see `actors.engine`). Must stay importable in the engine's processes,
so it imports only torch and vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class RelayWorkerExtension:
    """Methods added to vLLM's GPU/CPU worker class."""

    def relay_reload_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
                             path: str | None = None) -> int:
        """Load new weights in place through vLLM's reload path (restore, load, re-pack); return tensors loaded.

        A direct `model.load_weights` fails on the CPU backend, which pre-packs linear weights after loading.
        """
        tensors = list(named_tensors) if named_tensors is not None else None
        if tensors is not None:
            self.model_runner.reload_weights(weights_iterator=iter(tensors))
        else:
            self.model_runner.reload_weights(weights_path=path)
        self._relay_refresh_tied_head()
        return len(tensors) if tensors is not None else -1

    def _relay_refresh_tied_head(self) -> None:
        # With tied embeddings the checkpoint has no lm_head weight, so the reload skips the head and the CPU
        # backend keeps its OLD pre-packed copy: re-pack it from the (new) shared embedding weight.
        model = self.model_runner.get_model()
        config = getattr(model, "config", None)
        lm_head = getattr(model, "lm_head", None)
        if not getattr(config, "tie_word_embeddings", False) or lm_head is None:
            return
        method = getattr(lm_head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(lm_head)
