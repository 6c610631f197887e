"""What a training run writes to disk and reads back: resumable sharded checkpoints
(torch.distributed.checkpoint shards, RNG and trainer state, atomic `latest`: sharded.py; beside it
errors.py, files.py, layout.py, integrity.py (checksums) and rotation.py) and the Hugging Face export
of the trained model (safetensors shards streamed from the sharded parameters; hf_export.py).
Both go through a backend's state, never its internals:

    backend.sharded_state_dict() --save_checkpoint--> <root>/<tag>/dcp/ ... --load_checkpoint--> backend
    backend.save_hf(dir) --export_hf(module, one full tensor at a time)--> dir/*.safetensors, config.json
"""

from rlhfkit.checkpoint.layout import latest_checkpoint
from rlhfkit.checkpoint.sharded import load_checkpoint, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint"]
