# sparknet: `make demo` runs the main job locally, `make test` runs the tests.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch pinned: these builds install from local files here; any other would be a download.
TORCH  := torch==2.14.1 torchvision==0.29.1
# uv installs: it unpacks torch's 3 GB of CUDA wheels in parallel (both venvs from cold caches:
# pip 109 s, uv 77 s).
# It reads neither pip.conf nor PIP_* variables, so the indexes, find-links and constraints pip is
# configured with (`pip config list`: a local mirror, say) go to it as flags, and it picks the
# best version over all of them as pip does (uv's default takes the first index that has a name).
PIP_SOURCES = $(shell python3 -m pip config list 2>/dev/null | awk -F"'" ' \
	{ key = $$1; sub(/^[^.]*[.]/, "", key); sub(/=$$/, "", key) } \
	key == "constraint" { key = "constraints" } \
	key ~ /^(index-url|extra-index-url|find-links|constraints)$$/ { \
		n = split($$2, v, /[ \t]+/); \
		for (i = 1; i <= n; i++) if (v[i] != "" && !seen[key v[i]]++) printf "--%s %s ", key, v[i] }')
# bytecode at install: with PYTHONDONTWRITEBYTECODE set, every import would compile from source
UV_INSTALL = pip install --compile-bytecode --index-strategy unsafe-best-match $(PIP_SOURCES)
# checkov pins an older boto3 than moto needs: it gets a venv of its own
CHECKOV_VENV  := .venv-checkov
CHECKOV       := $(CHECKOV_VENV)/bin/checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed

.PHONY: install demo test lint bench clean checkov infra-check cluster-up cluster-down submit ami

install: $(STAMP)

$(STAMP): pyproject.toml
	@command -v java >/dev/null || { echo "error: Spark needs Java 17+ (apt-get install -y openjdk-17-jre-headless)"; exit 2; }
	@echo "installing sparknet, torch (a CUDA build: ~7 GB on disk) and Spark into $(VENV)/: about 2 minutes"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip uv
	$(VENV)/bin/uv $(UV_INSTALL) --python $(PY) $(TORCH) -e '.[dev]'
	touch $@

demo: install
	$(VENV)/bin/sparknet train --data digits --workers 2

# bytecode first: with PYTHONDONTWRITEBYTECODE set (CI images set it) every one of the suite's
# thousand-odd Python processes would compile sparknet from source again
# one test process per core and two more (a process often waits on a JVM, a subprocess or a
# timeout: with 3 on 2 cores a core stood idle an eighth of the time): 4 on 2 cores, at most 6
# (each may hold a few JVMs: about 2 GiB)
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); n=$$((n + 2)); echo $$((n < 4 ? 4 : n > 6 ? 6 : n)))

test: install checkov
	$(PY) -m compileall -q sparknet tests
	$(VENV)/bin/pytest -q -n $(TEST_JOBS)

checkov: $(CHECKOV_STAMP)

$(CHECKOV_STAMP):
	test -x $(CHECKOV_VENV)/bin/python || python3 -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q --upgrade pip uv
	$(CHECKOV_VENV)/bin/uv $(UV_INSTALL) --python $(CHECKOV_VENV)/bin/python 'checkov>=3.2,<4'
	touch $@

# the Terraform foundation: formatted, and no checkov finding that is not skipped inline with a reason
infra-check: checkov
	@command -v terraform >/dev/null || { echo "error: infra-check needs Terraform >= 1.9 on PATH"; exit 2; }
	terraform fmt -check -recursive infra tests/terraform_module tests/terraform_foundation
	$(CHECKOV) -d infra --framework terraform --quiet --compact --skip-download

# a GPU cluster on EC2 (needs AWS credentials): make cluster-up NAME=x WORKERS=4 SPOT=1
# Unset variables leave the setting to `clusters: NAME:` in sparknet.yaml, then the defaults.
NAME          ?= sparknet
WORKERS       ?=
INSTANCE_TYPE ?=
SPOT          ?=
REGION        ?=
AMI           ?=
BOOTSTRAP     ?= 1
cluster-up: install
	$(VENV)/bin/sparknet cluster up $(NAME) $(if $(WORKERS),--workers $(WORKERS)) \
		$(foreach t,$(INSTANCE_TYPE),--instance-type $(t)) \
		$(if $(filter 1 yes true,$(SPOT)),--spot) $(if $(filter 0 no false,$(SPOT)),--on-demand) \
		$(if $(REGION),--region $(REGION)) $(if $(AMI),--ami $(AMI)) \
		$(if $(filter 0 no false,$(BOOTSTRAP)),--no-bootstrap)

cluster-down: install
	$(VENV)/bin/sparknet cluster down $(NAME) $(if $(REGION),--region $(REGION))

# one training job on a new cluster, taken down after: make submit DATA=imagenet WORKERS=4 ARGS="..."
submit: install
	$(VENV)/bin/sparknet-submit --s3 $(DATA) $(if $(WORKERS),--workers $(WORKERS)) $(ARGS)

# a node image with the install steps done (needs AWS credentials; ami/README.md):
# make ami REGION=us-west-2 BASE_AMI=ami-... BUILDER_TYPE=g5.xlarge; `cluster up` then launches it
BASE_AMI      ?=
BUILDER_TYPE  ?=
ami: install
	$(VENV)/bin/sparknet ami bake $(if $(REGION),--region $(REGION)) \
		$(if $(BASE_AMI),--base-ami $(BASE_AMI)) $(if $(BUILDER_TYPE),--instance-type $(BUILDER_TYPE))

lint: install
	$(VENV)/bin/ruff check sparknet tests
	$(VENV)/bin/ruff format --check sparknet tests
	$(VENV)/bin/mkdocs build --strict --site-dir site

# the engine's figures, then the paper's analysis (sync, scaling, convergence, peers), all into
# bench/ (`sparknet bench --help`)
bench: install
	$(VENV)/bin/sparknet bench all
	$(VENV)/bin/sparknet bench sync
	$(VENV)/bin/sparknet bench scaling
	$(VENV)/bin/sparknet bench convergence
	$(VENV)/bin/sparknet bench peers --data imagenet-like --links unshaped,10gbit,1gbit,100mbit --budget-s 10
	$(VENV)/bin/sparknet bench peers --data imagenet-like-wide --links unshaped,1gbit,100mbit \
	    --contenders allreduce,distributor --tau 50 --outer average --variants none,int8+overlap \
	    --budget-s 75 --out bench/wide

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) *.egg-info .pytest_cache .ruff_cache
