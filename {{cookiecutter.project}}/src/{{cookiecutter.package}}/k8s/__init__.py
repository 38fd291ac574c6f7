"""The Kubernetes manifests in k8s/, rendered from the Hydra config: one source of truth.

    python -m {{ cookiecutter.package }}.k8s                                   # rewrite k8s/ from configs/
    python -m {{ cookiecutter.package }}.k8s deploy.nodes=2 deploy.runs_access_mode=ReadWriteMany   # several nodes: Indexed Job + Service
    python -m {{ cookiecutter.package }}.k8s --check                           # exit 1 and a diff if k8s/ differs from configs/
    python -m {{ cookiecutter.package }}.k8s.apply                             # make k8s-apply: onto the cluster, checked by its server first

Overrides are written into configs/ before k8s/ is rendered, so the next render, the check and
training all read them: configs/ stays the one source. Edit those files by hand just as well,
regenerate, then `make k8s-apply`. The env block is the composed nccl profile's explicit variables
(auto decides the rest at start-up); torchrun's arguments come from deploy.nodes and
deploy.gpus_per_node.

One concern per module, each importing only those above it:

    meta.py      labels, object metadata and quantities, which every object shares
    pods.py      the trainer container, torchrun's launch line, the pod spec, the runs claim
    flavors.py   one builder per workload kind, in the table FLAVORS (a new flavor: a builder
                 and an entry)
    checks.py    the deploy group's values, refused in one line where the API server would
                 refuse them
    render.py    k8s/'s files as text, and the notes printed beside them
    sync.py      k8s/ on disk: compared, diffed, or replaced all at once under a lock
    persist.py   overrides into configs/, keeping the YAML as its author wrote it (ruamel.yaml)
    cluster.py   kubectl's calls, each bounded and its failure one line, and the server's dry run
    __main__.py  the command line above
    apply.py     make k8s-apply
    doctor.py    make k8s-doctor: the doctor's Job, from the same pods, beside the training job

All but persist, __main__, apply and doctor need only the standard library and PyYAML: the
template's post-generation hook renders the first k8s/ with them, before anything is installed.
"""  # noqa: E501
