"""{{ cookiecutter.project }}: DDP training with Hydra configs, ready for Kubernetes."""

PROJECT = "{{ cookiecutter.project }}"  # also the launcher's command: `<project> train`
PACKAGE = __name__  # what python -m, Hydra and importlib name this package by: one spelling
