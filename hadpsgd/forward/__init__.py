"""Forward pass for decoding: a trained BLSTM's per-frame scores (``python -m hadpsgd.forward``).

The layer sits beside ``run``: it loads a checkpoint (:mod:`hadpsgd.train.checkpoint`),
rebuilds the model (:mod:`hadpsgd.models`), reads features (:mod:`hadpsgd.data`), splits the
utterances over MPI ranks (:mod:`hadpsgd.comm`) and writes log-posteriors or, divided by the
class priors (:mod:`hadpsgd.data.priors`), pseudo-log-likelihoods. docs/forward.md has the
command, the output layout and the measurement behind the default context.
"""

from hadpsgd.forward.chunks import CONTEXTS, forward_utterance, window_plan
from hadpsgd.forward.model import ForwardError, LoadedModel, find_checkpoint, load_model
from hadpsgd.forward.output import FORMAT, OutputSpec, parse_output

__all__ = ["CONTEXTS", "FORMAT", "ForwardError", "LoadedModel", "OutputSpec", "find_checkpoint",
           "forward_utterance", "load_model", "parse_output", "window_plan"]
