"""Train an image classifier: python run.py [group=option ...] [key=value ...]"""
import sys


def interrupted() -> SystemExit:
    print("interrupted", file=sys.stderr)  # before the run's folder has anything to continue from
    return SystemExit(130)  # as a shell reports SIGINT


try:  # Ctrl-C while the imports load (a second or more) ends as it does once the run has started
    import hydra

    from trainer import app, dist
    from trainer.config import register
except KeyboardInterrupt:
    raise interrupted() from None

register()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg):
    return app.main(cfg)


if __name__ == "__main__":
    sys.argv += dist.launch_overrides(sys.argv[1:])  # under torchrun: one run directory for the job
    try:
        main()
    except KeyboardInterrupt:  # while Hydra composes the configuration, before app.main's own handling
        raise interrupted() from None
