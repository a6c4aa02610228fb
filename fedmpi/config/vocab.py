"""The names a config field takes, one tuple per field. The config checks
(fedmpi.config.validate, validate_system) refuse anything else, and the modules that act
on a field import its names from here: the config layer knows its vocabulary without
importing the runtime or the algorithms, which import it."""

# [clients] (fedmpi.runtime.plan)
SAMPLING = ("uniform", "bernoulli", "size")
EMPTY_ROUNDS = ("redraw", "skip")

# [train] (fedmpi.algorithms.schedule, fedmpi.algorithms.local_sgd)
ROUND_SCHEDULES = ("exponential", "step", "cosine")
LOCAL_SCHEDULES = ("constant", "step", "cosine")
LOCAL_OPTIMIZERS = ("sgd", "adam")

# [eval] (fedmpi.runtime.probes) and [system]
PROBES = ("linear", "finetune", "spectrum")
FINETUNE_HEADS = ("raw", "l2")
LINEAR_HEADS = ("raw", "standard")
PRECISIONS = ("fp32", "tf32", "bf16")

# [compression] (fedmpi.runtime.compression)
UP_CODECS = ("none", "fp16", "bf16", "qsgd", "topk", "randk", "sign")
DOWN_CODECS = ("none", "fp16", "bf16")
FEEDBACK = ("ef", "ef21")

# [system_model] (fedmpi.runtime.vclock, devices, availability, asyncfl)
PROFILES = ("off", "lognormal", "tiers", "file")
STEP_UNITS = ("step", "sample")
POLICIES = ("wait_all", "deadline", "overselect", "fedasync", "fedbuff")
ASYNC_MODES = ("fedasync", "fedbuff")   # the asynchronous ones of POLICIES
STALENESS = ("constant", "polynomial")
AVAILABILITY = ("always", "bernoulli", "markov", "diurnal", "trace")

# [privacy] (fedmpi.runtime.dp, fedmpi.privacy)
PRIVACY_MECHANISMS = ("off", "central", "local", "sample")
PRIVACY_LOCAL_NOISES = ("gaussian", "laplace")
PRIVACY_ACCOUNTANTS = ("auto", "pld", "rdp")

GROUP_MAX = 4096   # clients in one lock-step group; each holds a model copy in memory
