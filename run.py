"""Train an image classifier: python run.py [group=option ...] [key=value ...]"""
import signal
import sys

from trainer.signals import held


def interrupted(what: str = "interrupted", status: int = 130) -> SystemExit:
    print(what, file=sys.stderr)  # before the run's folder has anything to continue from, or between a sweep's jobs
    return SystemExit(status)  # as a shell reports SIGINT (SIGTERM: 143)


def terminated(signum, frame):
    raise interrupted("terminated", 143)


signal.signal(signal.SIGTERM, terminated)  # until app.main takes it: said, where it ended the process without a word
try:  # Ctrl-C while the imports load (a second or more) ends as it does once the run has started
    with held():  # taken once torch, numpy and Hydra have loaded whole
        import hydra

        from trainer import app, dist
        from trainer.config import refused_override, register
        from trainer.errors import ConfigError
except KeyboardInterrupt:
    raise interrupted() from None

register()
sys.stdout.reconfigure(errors="backslashreplace")  # the log's console: as stderr writes a name that is not UTF-8


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg):
    return app.main(cfg)


if __name__ == "__main__":
    try:
        sys.argv += dist.launch_overrides(sys.argv[1:])  # under torchrun: one run directory for the job
    except ConfigError as e:  # torchrun's variables, set by hand and wrong; a sweep or an export under torchrun
        app.say_refusal(e, e.alike)
        raise SystemExit(2) from None
    refused = refused_override(sys.argv[1:])
    if refused:  # in one line, before Hydra; under torchrun, every rank's command line
        app.say_refusal(refused, alike=True)
        raise SystemExit(2)
    try:
        main()
    except KeyboardInterrupt:  # while Hydra composes the configuration, before app.main's own handling
        raise interrupted() from None
    except app.Terminated:  # SIGTERM (app.main takes it) while Hydra writes a sweep's next job's folder
        raise interrupted("terminated", 143) from None
