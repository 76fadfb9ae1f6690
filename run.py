"""Train an image classifier: python run.py [group=option ...] [key=value ...]"""
import sys

import hydra

from trainer import app, dist
from trainer.config import register

register()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg):
    app.main(cfg)


if __name__ == "__main__":
    sys.argv += dist.launch_overrides(sys.argv[1:])  # under torchrun: one run directory for the job
    main()
