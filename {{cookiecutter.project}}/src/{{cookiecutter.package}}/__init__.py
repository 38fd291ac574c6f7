"""{{ cookiecutter.project }}: DDP training with Hydra configs, ready for Kubernetes."""

PROJECT = {{ cookiecutter.project | py_str }}  # also the launcher's command: `<project> train`
