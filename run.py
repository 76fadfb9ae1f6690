"""Train an image classifier: python run.py [group=option ...] [key=value ...]"""
import hydra

from trainer import app
from trainer.config import register

register()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg):
    app.main(cfg)


if __name__ == "__main__":
    main()
