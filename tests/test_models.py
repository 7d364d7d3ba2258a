"""Models listed: ``GET .../providers``, the workspace's ``config``, choosing a model with
``POST .../config/model``, the default small model, and the ``crush-trio models`` command."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any, Final

import orjson
import pytest
import trio

from crush_trio.client import BadRequest, NotFound, WorkspaceClient
from crush_trio.models_cmd import list_models
from crush_trio.providers.scripted import ScriptedModel
from crush_trio.wire import CatalogModel, ModelChoice
from tests.conftest import WAIT, running_server

if TYPE_CHECKING:
    from pathlib import Path

    from crush_trio.testing import CrushServer

SECRET: Final = "sk-models-secret"
CONFIG: Final = {
    "providers": {
        "local": {
            "type": "openai",
            "base_url": "http://127.0.0.1:9/v1",
            "api_key": SECRET,
            "extra_headers": {"Authorization": f"Bearer {SECRET}"},
            "models": [
                {"id": "small-1", "context_window": 32000},
                {
                    "id": "big-1",
                    "name": "Big One",
                    "context_window": 200000,
                    "default_max_tokens": 8192,
                    "cost_per_1m_in": 3.0,
                    "cost_per_1m_out": 15.0,
                    "cost_per_1m_in_cached": 3.75,
                    "cost_per_1m_out_cached": 0.3,
                },
            ],
        },
        "anything": {"type": "openai-compat", "base_url": "http://127.0.0.1:9/v1"},
    },
    "models": {
        "large": {"provider": "local", "model": "big-1"},
        "small": {"provider": "local", "model": "small-1"},
    },
    "options": {"default_context_window": 64000},
}


@pytest.fixture
def crush_config() -> dict[str, Any]:
    return CONFIG


async def test_providers_list_each_model_with_its_window_bounds_and_prices(
    crush_workspace: WorkspaceClient,
) -> None:
    ws = crush_workspace
    raw = await ws.client.request("GET", f"/v1/workspaces/{ws.id}/providers")
    assert SECRET not in orjson.dumps(raw).decode()
    providers = {p.id: p for p in await ws.providers()}
    assert list(providers) == ["local", "anything", "echo"]
    local = providers["local"]
    assert (local.type, local.api_endpoint) == ("openai", "http://127.0.0.1:9/v1")
    assert (local.default_large_model_id, local.default_small_model_id) == ("big-1", "small-1")
    assert local.models == [
        CatalogModel("small-1", "small-1", context_window=32000),  # no name: the id
        CatalogModel("big-1", "Big One", 3.0, 15.0, 3.75, 0.3, 200000, 8192),
    ]
    # A provider that lists no models takes any id: none to show, no default.
    assert providers["anything"].models == []
    assert providers["anything"].default_large_model_id == ""
    # No context_window given: the server's options.default_context_window applies.
    assert [m.id for m in providers["echo"].models] == ["echo"]
    assert providers["echo"].models[0].context_window == 64000
    # The workspace object carries the same in Crush's config shape, without the key.
    info = ws.info
    assert info.config is not None
    assert info.config.models == {
        "large": ModelChoice("local", "big-1"),
        "small": ModelChoice("local", "small-1"),
    }
    assert info.config.providers["local"].base_url == "http://127.0.0.1:9/v1"
    assert info.config.providers["local"].models == local.models
    assert info.config.options.data_directory == info.data_dir
    workspace = await ws.client.request("GET", f"/v1/workspaces/{ws.id}")
    config = await ws.client.request("GET", f"/v1/workspaces/{ws.id}/config")
    assert SECRET not in orjson.dumps([workspace, config]).decode()
    assert config == workspace["config"]


async def test_a_chosen_model_is_used_from_the_next_turn_on(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    url = f"/v1/workspaces/{ws.id}"
    session = await ws.create_session()
    with trio.fail_after(WAIT):
        await (await ws.prompt(session.id, "one")).result(WAIT)
        assert scripted_model.requests[-1].model.id == "big-1"
        body = {
            "scope": 1,
            "model_type": "large",
            "model": {"provider": "local", "model": "small-1"},
        }
        assert await ws.client.request("POST", url + "/config/model", json=body) == {}
        info = await ws.agent_info()
        assert info.model_cfg == ModelChoice("local", "small-1")
        assert info.model["id"] == "small-1"
        assert info.model["context_window"] == 32000
        await (await ws.prompt(session.id, "two")).result(WAIT)
        assert scripted_model.requests[-1].model.id == "small-1"
        # Any id goes for a provider that lists none; the workspace config shows it then.
        body["model"] = {"provider": "anything", "model": "whatever-7b"}
        await ws.client.request("POST", url + "/config/model", json=body)
        config = await ws.client.request("GET", url + "/config")
        assert config["models"]["large"] == {"provider": "anything", "model": "whatever-7b"}
        assert [m["id"] for m in config["providers"]["anything"]["models"]] == ["whatever-7b"]


async def test_bad_model_choices_are_refused_with_the_reason(
    crush_workspace: WorkspaceClient,
) -> None:
    ws = crush_workspace
    url = f"/v1/workspaces/{ws.id}"
    model = {"provider": "local", "model": "huge-9"}
    with pytest.raises(BadRequest, match="'huge-9' is not in"):
        await ws.client.request(
            "POST", url + "/config/model", json={"model_type": "large", "model": model}
        )
    model = {"provider": "nope", "model": "x"}
    with pytest.raises(BadRequest, match=r"model: .*nope"):
        await ws.client.request(
            "POST", url + "/config/model", json={"model_type": "small", "model": model}
        )
    model = {"provider": "local", "model": "big-1"}
    with pytest.raises(BadRequest, match="scope 7"):
        await ws.client.request(
            "POST", url + "/config/model", json={"scope": 7, "model_type": "large", "model": model}
        )
    with pytest.raises(BadRequest, match=r"\$.model_type"):
        await ws.client.request(
            "POST", url + "/config/model", json={"model_type": "medium", "model": model}
        )
    # Nothing changed.
    assert (await ws.agent_info()).model_cfg == ModelChoice("local", "big-1")


async def test_default_small_model_of_a_provider(crush_workspace: WorkspaceClient) -> None:
    ws = crush_workspace
    url = f"/v1/workspaces/{ws.id}/agent/default-small-model"
    small = await ws.client.request("GET", url, params={"provider_id": "local"})
    assert small == {"provider": "local", "model": "small-1"}
    echo = await ws.client.request("GET", url, params={"provider_id": "echo"})
    assert echo == {"provider": "echo", "model": "echo"}
    with pytest.raises(NotFound, match="lists no models"):
        await ws.client.request("GET", url, params={"provider_id": "anything"})
    with pytest.raises(NotFound, match="no provider 'gone'"):
        await ws.client.request("GET", url, params={"provider_id": "gone"})
    with pytest.raises(BadRequest, match="provider_id is required"):
        await ws.client.request("GET", url)


async def test_models_command_lists_what_run_m_takes(
    crush_server: CrushServer, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    out, err = io.StringIO(), io.StringIO()
    with trio.fail_after(WAIT):
        code = await list_models(crush_server.url, crush_server.token, project, "text", out, err)
    assert code == 0, err.getvalue()
    lines = out.getvalue().splitlines()
    assert lines[0] == "local (openai) http://127.0.0.1:9/v1"
    big = next(line for line in lines if line.strip().startswith("local/big-1"))
    assert big.split() == [
        "local/big-1", "Big", "One", "context", "200000", "max", "8192",
        "in", "$3", "out", "$15", "per", "1M", "large",
    ]  # fmt: skip
    small = next(line for line in lines if line.strip().startswith("local/small-1"))
    assert small.split()[-1] == "small"
    assert "max -" in small
    assert "anything (openai-compat) http://127.0.0.1:9/v1" in lines
    assert any(line.strip().startswith("echo/echo") for line in lines)
    assert SECRET not in out.getvalue()
    out = io.StringIO()
    with trio.fail_after(WAIT):
        code = await list_models(crush_server.url, crush_server.token, project, "json", out, err)
    assert code == 0
    listed = orjson.loads(out.getvalue())
    assert [p["id"] for p in listed] == ["local", "anything", "echo"]
    assert listed[0]["models"][1]["cost_per_1m_out"] == 15.0
    out = io.StringIO()
    code = await list_models(crush_server.url, "wrong-token", project, "text", out, err)
    assert code == 3
    assert out.getvalue() == ""


@pytest.mark.slow
async def test_models_command_embedded(tmp_path: Path) -> None:
    """``crush-trio models`` with no server: an embedded one answers with the user's config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRUSH_TRIO_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    with trio.fail_after(60):
        done = await trio.run_process(
            [sys.executable, "-m", "crush_trio", "models", "--workspace", str(tmp_path)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().splitlines()[0] == "echo (echo)"
    assert "echo/echo" in done.stdout.decode()
    assert "large" in done.stdout.decode()
    with trio.fail_after(60):
        done = await trio.run_process(
            [sys.executable, "-m", "crush_trio", "models", "--token", "t"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    assert done.returncode == 2
    assert b"--token needs --server" in done.stderr


async def test_a_chosen_model_outlives_a_reload_while_it_is_still_configured(
    tmp_path: Path,
) -> None:
    """``config/model`` choices are kept over a trust reload, and dropped (back to the
    configuration's own models) when the reload takes their provider away."""
    user = tmp_path / "user-config"
    user.mkdir()
    (user / "crush.json").write_bytes(orjson.dumps({**CONFIG, "models": {}}))
    project = tmp_path / "project"
    project.mkdir()
    own = {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "models": [{"id": "m-1"}]}
    (project / "crush.json").write_bytes(orjson.dumps({"providers": {"mine": own}}))

    async def model_cfg() -> Any:
        r = await srv.http.get(f"/v1/workspaces/{wid}/agent")
        return r.json()["model_cfg"]

    async def choose(provider: str, model: str) -> int:
        body = {"model_type": "large", "model": {"provider": provider, "model": model}}
        r = await srv.http.post(f"/v1/workspaces/{wid}/config/model", json=body)
        return r.status_code

    with trio.fail_after(WAIT * 2):
        async with running_server(tmp_path, provider_factory=ScriptedModel()) as srv:
            wid = (await srv.open_workspace(project))["id"]
            assert await model_cfg() == {"provider": "local", "model": "small-1"}
            assert await choose("mine", "m-1") == 400  # untrusted: its own provider is ignored
            assert await choose("local", "big-1") == 200
            r = await srv.http.post(f"/v1/workspaces/{wid}/trust", json={"trusted": True})
            assert r.status_code == 200, r.text
            assert await model_cfg() == {"provider": "local", "model": "big-1"}  # kept
            assert await choose("mine", "m-1") == 200
            r = await srv.http.post(f"/v1/workspaces/{wid}/trust", json={"trusted": False})
            assert r.status_code == 200, r.text
            # "mine" is gone: the choice goes with it instead of breaking the next turn.
            assert await model_cfg() == {"provider": "local", "model": "small-1"}
            r = await srv.http.get(f"/v1/workspaces/{wid}/providers")
            assert [p["id"] for p in r.json()] == ["local", "anything", "echo"]
