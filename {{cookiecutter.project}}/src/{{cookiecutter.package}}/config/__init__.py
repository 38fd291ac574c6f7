"""The config: typed schemas, the option registry, the command line, the whole-config checks."""
