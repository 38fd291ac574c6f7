#!/usr/bin/env bash
# Wheels for the GPU machine, which has no package registry: what ../shared/device/fetch-wheels.sh
# fetches (hydra, omegaconf, cookiecutter), plus the generated project's metrics dependencies
# (tensorboard, matplotlib), pytest-xdist, which its pytest options name, and PyTorch Lightning
# for benchmarks/peer only (not a dependency of the project). That machine already has torch,
# numpy, rich, pyyaml and jinja2.
# Run here, from the repo root; then carry .whl in the device call.
set -euo pipefail
exec ../shared/device/fetch-wheels.sh \
  tensorboard==2.21.0 tensorboard-data-server==0.7.2 grpcio==1.85.3 protobuf==7.36.2 absl-py==2.5.1 \
  markdown==3.11.3 werkzeug==3.1.9 markupsafe==3.0.4 pillow==13.0.0 \
  matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1 \
  pyparsing==3.3.3 python-dateutil==4.0.0 six==1.17.0 packaging==26.4 \
  pytest-xdist==3.8.0 execnet==2.1.2 \
  pytorch-lightning==2.6.6 torchmetrics==1.9.0 lightning-utilities==0.15.3 fsspec==2026.9.0 tqdm==4.70.1
