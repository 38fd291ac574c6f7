"""{{ cookiecutter.project }}: DDP training with Hydra configs, ready for Kubernetes."""

PROJECT = "{{ cookiecutter.project }}"  # also the launcher's command: `<project> train`
