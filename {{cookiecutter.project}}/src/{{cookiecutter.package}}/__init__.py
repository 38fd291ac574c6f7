"""{{ cookiecutter.project }}: DDP training with Hydra configs, ready for Kubernetes."""
