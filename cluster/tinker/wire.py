"""The Tinker API's binary wire format on relay's side: a `forward_backward` request (protobuf, in the schema the
`tinker` package publishes, `tinker.proto.tinker_public_pb2`) read into relay's `Datum`s, and the
`ForwardBackwardOutput` (per-datum logprobs and the loss's metrics) written back as the SDK reads it.

Owns: decoding chunks and tensors, checking each datum's fields (one line naming the field and the fix), encoding the
output. Does not own: the JSON routes, sessions and futures (cluster/tinker/service.py), the losses (learner/datums.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from learner.datums import Datum

INSTALL = "relay serve needs the Tinker SDK's wire schema: pip install tinker==0.38.0"


def schema() -> Any:
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as err:
        raise RuntimeError(INSTALL) from err
    return tinker_public_pb2


@dataclass
class ForwardBackwardRequest:
    """A decoded `/api/v1/forward_backward` body."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    datums: list[Datum] = field(default_factory=list)
    config: dict[str, float] = field(default_factory=dict)  # loss_fn_config


class WireError(ValueError):
    """A request the SDK sent that relay cannot read or that is malformed: a user error, one line."""


def read_forward_backward(body: bytes, vocab_size: int | None = None) -> ForwardBackwardRequest:
    """The request in `body`; a `WireError` naming the datum and field that is wrong."""
    pb = schema()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as err:  # protobuf's DecodeError, and whatever a truncated body raises
        raise WireError(f"the forward_backward body is not a ForwardBackwardRequest ({err}); send it with the "
                        "tinker SDK") from None
    datums = [_datum(pb, d, i, vocab_size) for i, d in enumerate(msg.data)]
    if not datums:
        raise WireError("forward_backward got no data; send at least one Datum")
    config = {name: float(value) for name, value in msg.loss_fn_config.items()}
    for name, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise WireError(f"loss_fn_config['{name}'] is text ({value.text!r}); relay's losses take numbers")
        config[name] = float(value.number)
    return ForwardBackwardRequest(msg.model_id, msg.seq_id, msg.loss_fn, msg.forward_only, datums, config)


def _datum(pb: Any, msg: Any, index: int, vocab_size: int | None) -> Datum:
    tokens: list[int] = []
    for chunk in msg.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise WireError(f"data[{index}].model_input holds a {chunk.WhichOneof('chunk')} chunk; relay serves text "
                            "models: send token chunks (EncodedTextChunk) only")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    inputs = {name: _tensor(pb, t, f"data[{index}].loss_fn_inputs['{name}']") for name, t in msg.loss_fn_inputs.items()}
    if "target_tokens" not in inputs:
        raise WireError(f"data[{index}].loss_fn_inputs has no 'target_tokens'; give the token each position predicts")
    targets = [int(t) for t in inputs["target_tokens"]]
    if len(targets) != len(tokens):
        raise WireError(f"data[{index}]: target_tokens has {len(targets)} tokens for a model_input of {len(tokens)}; "
                        "give one target per input token")
    if vocab_size is not None:
        for name, ids in (("model_input", tokens), ("target_tokens", targets)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise WireError(f"data[{index}].{name} holds token {bad[0]}, outside the model's vocabulary of "
                                f"{vocab_size}; tokenize with the served model's tokenizer")
    per_token = {}
    for name in ("weights", "advantages", "logprobs"):
        if name in inputs:
            if len(inputs[name]) != len(tokens):
                raise WireError(f"data[{index}].loss_fn_inputs['{name}'] has {len(inputs[name])} values for "
                                f"{len(tokens)} tokens; give one per token")
            per_token[name] = [float(v) for v in inputs[name]]
    return Datum(tokens, targets, per_token.get("weights"), per_token.get("advantages"), per_token.get("logprobs"))


def _tensor(pb: Any, msg: Any, where: str) -> np.ndarray:
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise WireError(f"{where} has dtype {pb.DType.Name(msg.dtype)}; send float32 or int64")
    if msg.HasField("sparse_csr"):
        raise WireError(f"{where} is sparse; relay takes dense tensors: send it dense")
    return np.frombuffer(msg.dense, dtype=dtypes[msg.dtype]).reshape(-1)


def write_forward_backward_output(rows: list[list[float]], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput`: each datum's `logprobs` ([N_i], float32) in one batched record, and the metrics."""
    pb = schema()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for name, value in metrics.items():
        out.metrics[name] = value
    record = out.loss_fn_outputs.add(num_datums=len(rows))
    arrays = [np.asarray(row, dtype=np.float32) for row in rows]
    offsets = np.cumsum([0, *(a.nbytes for a in arrays)], dtype=np.int64)
    batched = record.fields["logprobs"]
    batched.data = b"".join(a.tobytes() for a in arrays)
    batched.offsets = offsets.tobytes()
    batched.dtype = pb.DTYPE_FLOAT32
    return out.SerializeToString()
