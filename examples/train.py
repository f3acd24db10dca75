"""Train a causal LM on long sequences with Ulysses SP, set up by the DeepSpeed config's "ulysses" section.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train.py --deepspeed_config examples/ds_config_cpu.json
    torchrun --nproc_per_node 2 examples/train.py --deepspeed_config examples/ds_config_cpu.json

`python examples/train.py --help` lists the options; the job itself is ds_ulysses.train.job.
"""

from ds_ulysses.train.job import leave, main, train

__all__ = ["main", "train"]

if __name__ == "__main__":
    leave(main())
