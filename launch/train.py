"""Training entry point for the `deepspeed` launcher, `torchrun`, or plain `python` (one process).

    deepspeed --num_gpus 8 launch/train.py --config launch/configs/multi30k_en_de.yaml \
        --deepspeed_config ds_configs/zero2.json train.max_steps=20000
"""

import sys

from dsmt.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
