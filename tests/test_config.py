"""Loading ``crush.json``: lookup and merge, strict types with JSON paths, model selection."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import orjson
import pytest

from crush_trio.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_STEPS,
    PROVIDER_TYPES,
    Config,
    ModelEntry,
    Models,
    Options,
    ProviderConfig,
    SelectedModel,
    builtin_echo,
    config_to_json,
    load_config,
)
from crush_trio.errors import ConfigError

if TYPE_CHECKING:
    from pathlib import Path

PROTOCOL_EXAMPLE: dict[str, Any] = {
    "providers": {
        "local": {
            "type": "openai-compat",
            "base_url": "http://127.0.0.1:11434/v1",
            "api_key": "$LOCAL_API_KEY",
            "models": [
                {
                    "id": "qwen3:8b",
                    "name": "Qwen 3 8B",
                    "context_window": 32768,
                    "default_max_tokens": 4096,
                }
            ],
        }
    },
    "models": {
        "large": {"provider": "local", "model": "qwen3:8b"},
        "small": {"provider": "local", "model": "qwen3:8b"},
    },
    "options": {"data_directory": ".crush"},
    "permissions": {"allowed_tools": ["view", "ls"]},
}


def write(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def load_file(path: Path, env: dict[str, str] | None = None) -> Config:
    return load_config(config_file=path, workspace=None, env=env or {})


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    """(user config dir, workspace dir), both empty."""
    user, workspace = tmp_path / "user", tmp_path / "ws"
    user.mkdir()
    workspace.mkdir()
    return user, workspace


def load_layered(dirs: tuple[Path, Path], env: dict[str, str] | None = None) -> Config:
    user, workspace = dirs
    return load_config(config_file=None, workspace=workspace, env=env or {}, user_config_dir=user)


# --- defaults and lookup ----------------------------------------------------------------------


def test_missing_files_give_defaults_and_the_echo_model(dirs: tuple[Path, Path]) -> None:
    config = load_layered(dirs)
    assert config == Config()
    assert config.options.max_steps == DEFAULT_MAX_STEPS
    assert config.server.max_body_bytes == DEFAULT_MAX_BODY_BYTES
    assert config.options.permission_timeout is None
    assert config.resolve_model("large") == builtin_echo()
    assert config.resolve_model("small") == (
        "echo",
        ProviderConfig(type="echo"),
        ModelEntry("echo"),
    )


def test_empty_object_file_gives_defaults(tmp_path: Path) -> None:
    assert load_file(write(tmp_path / "c.json", {})) == Config()


def test_user_file_found_under_xdg_config_home(tmp_path: Path) -> None:
    write(tmp_path / "xdg" / "crush-trio" / "crush.json", {"options": {"max_steps": 7}})
    config = load_config(
        config_file=None, workspace=None, env={"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    )
    assert config.options.max_steps == 7


def test_protocol_example_loads(tmp_path: Path) -> None:
    path = write(tmp_path / "crush.json", PROTOCOL_EXAMPLE)
    config = load_file(path, env={"LOCAL_API_KEY": "sekrit"})
    local = config.providers["local"]
    assert local.type == "openai-compat"
    assert local.base_url == "http://127.0.0.1:11434/v1"
    assert local.api_key == "sekrit"
    assert local.models == [ModelEntry("qwen3:8b", "Qwen 3 8B", 32768, 4096)]
    assert config.models.large == SelectedModel("local", "qwen3:8b")
    assert config.permissions.allowed_tools == ["view", "ls"]
    assert config.resolve_model("small") == ("local", local, local.models[0])


def test_explicit_config_file_ignores_user_and_workspace_files(
    tmp_path: Path, dirs: tuple[Path, Path]
) -> None:
    user, workspace = dirs
    write(user / "crush.json", {"options": {"max_steps": 1}})
    write(workspace / "crush.json", {"options": {"title_max_words": 2}})
    only = write(tmp_path / "only.json", {"options": {"debounce_ms": 5}})
    config = load_config(config_file=only, workspace=workspace, env={}, user_config_dir=user)
    assert config.options == Options(debounce_ms=5)


def test_explicit_config_file_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.json: config file not found"):
        load_file(tmp_path / "missing.json")


def test_workspace_files_merge_over_user_file(dirs: tuple[Path, Path]) -> None:
    user, workspace = dirs
    write(
        user / "crush.json",
        {
            "providers": {"p": {"type": "openai", "api_key": "u", "models": [{"id": "m1"}]}},
            "options": {"max_steps": 3, "tool_timeout": 9},
            "permissions": {"allowed_tools": ["view", "ls"]},
            # Only a trusted workspace's files may change a provider or pre-approve tools.
            "trusted_workspaces": [str(workspace)],
        },
    )
    write(
        workspace / "crush.json",
        {
            "providers": {"p": {"base_url": "http://ws"}},
            "options": {"max_steps": 4, "title_max_words": 5},
            "permissions": {"allowed_tools": ["bash"]},
        },
    )
    write(workspace / ".crush.json", {"options": {"max_steps": 6}})
    config = load_layered(dirs)
    provider = config.providers["p"]
    # Objects merge key by key: the user's type and key survive the workspace's base_url.
    assert (provider.type, provider.api_key, provider.base_url) == ("openai", "u", "http://ws")
    # Later files win: .crush.json over crush.json over the user file.
    assert config.options.max_steps == 6
    assert config.options.title_max_words == 5
    assert config.options.tool_timeout == 9
    # Lists are replaced, not concatenated.
    assert config.permissions.allowed_tools == ["bash"]


def test_error_names_the_file_that_set_the_bad_value(dirs: tuple[Path, Path]) -> None:
    user, workspace = dirs
    write(user / "crush.json", {"options": {"max_steps": 3}})
    bad = write(workspace / ".crush.json", {"options": {"max_steps": "many"}})
    with pytest.raises(ConfigError) as info:
        load_layered(dirs)
    assert str(info.value).startswith(f"{bad}: $.options.max_steps: expected int")


# --- environment expansion ---------------------------------------------------------------------


def test_dollar_var_and_braced_var_expand_in_key_url_and_headers(tmp_path: Path) -> None:
    path = write(
        tmp_path / "c.json",
        {
            "providers": {
                "p": {
                    "type": "anthropic",
                    "api_key": "$KEY",
                    "base_url": "https://${HOST}/v1",
                    "extra_headers": {"X-Org": "org-${ORG}-$ORG", "X-Plain": "a $ b"},
                    # Only api_key, base_url and extra_headers expand.
                    "models": [{"id": "$KEY"}],
                }
            }
        },
    )
    config = load_file(path, env={"KEY": "k1", "HOST": "api.test", "ORG": "7"})
    provider = config.providers["p"]
    assert provider.api_key == "k1"
    assert provider.base_url == "https://api.test/v1"
    assert provider.extra_headers == {"X-Org": "org-7-7", "X-Plain": "a $ b"}
    assert provider.models[0].id == "$KEY"


def test_unset_variable_expands_to_empty_and_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="crush_trio.config")
    path = write(tmp_path / "c.json", {"providers": {"p": {"type": "echo", "api_key": "$NOPE"}}})
    config = load_file(path, env={})
    assert config.providers["p"].api_key == ""
    assert "$.providers.p.api_key: environment variable NOPE is not set" in caplog.text


# --- errors ---------------------------------------------------------------------------------------


def test_unknown_provider_type_names_path_and_allowed_types(tmp_path: Path) -> None:
    path = write(tmp_path / "c.json", {"providers": {"local": {"type": "ollama"}}})
    with pytest.raises(ConfigError) as info:
        load_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: $.providers.local.type: unknown provider type 'ollama'")
    for allowed in PROVIDER_TYPES:
        assert repr(allowed) in message


def test_missing_provider_type_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path / "c.json", {"providers": {"local": {"base_url": "http://x"}}})
    with pytest.raises(ConfigError, match=r"\$\.providers\.local\.type: required key missing"):
        load_file(path)


def test_wrong_types_are_all_reported_with_paths(tmp_path: Path) -> None:
    data = {
        "providers": {
            "local": {
                "type": "openai-compat",
                "models": [{"id": "m", "context_window": "32768"}],
                "extra_headers": {"X-A": 1},
            }
        },
        "options": {"debounce_ms": True},
    }
    path = write(tmp_path / "crush.json", data)
    with pytest.raises(ConfigError) as info:
        load_file(path)
    lines = str(info.value).splitlines()
    assert (
        f"{path}: $.providers.local.models[0].context_window: expected int, got str"
        in (lines[0].split(";")[0])
    )
    assert any("$.providers.local.extra_headers.X-A: expected str" in line for line in lines)
    assert any("$.options.debounce_ms: expected number" in line for line in lines)
    assert all(line.endswith("fix the value in the file") for line in lines)


def test_string_where_list_expected_is_an_error_not_a_list_of_characters(tmp_path: Path) -> None:
    path = write(tmp_path / "c.json", {"permissions": {"allowed_tools": "bash"}})
    with pytest.raises(ConfigError, match=r"\$\.permissions\.allowed_tools: expected an array"):
        load_file(path)


def test_list_where_object_expected_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path / "c.json", {"providers": []})
    with pytest.raises(ConfigError, match=r"\$\.providers: expected an object, got array"):
        load_file(path)


def test_top_level_must_be_an_object(tmp_path: Path) -> None:
    path = write(tmp_path / "c.json", [])
    with pytest.raises(ConfigError, match=r"\$: expected a JSON object, got array"):
        load_file(path)


def test_invalid_json_names_file_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path / "crush.json", '{\n  "options": {\n    "max_steps": 5,\n  }\n}')
    with pytest.raises(ConfigError) as info:
        load_file(path)
    assert str(info.value).startswith(f"{path}: invalid JSON at line 3 column 19")


def test_negative_and_zero_bounds_are_errors(tmp_path: Path) -> None:
    path = write(
        tmp_path / "c.json",
        {
            "providers": {"p": {"type": "echo", "max_retries": -1}},
            "server": {"detach_grace": -0.5, "max_body_bytes": 0},
        },
    )
    with pytest.raises(ConfigError) as info:
        load_file(path)
    message = str(info.value)
    assert "$.providers.p.max_retries: must not be negative" in message
    assert "$.server.detach_grace: must not be negative" in message
    assert "$.server.max_body_bytes: must be greater than 0" in message


def test_reasoning_options_are_checked(tmp_path: Path) -> None:
    def provider(*models: dict[str, Any]) -> dict[str, Any]:
        return {"providers": {"p": {"type": "anthropic", "models": list(models)}}}

    bad_effort = write(tmp_path / "a.json", provider({"id": "b", "reasoning_effort": "extreme"}))
    with pytest.raises(ConfigError, match=r"\$\.providers\.p\.models\[0\]\.reasoning_effort"):
        load_file(bad_effort)
    small = write(tmp_path / "b.json", provider({"id": "a"}, {"id": "b", "thinking_budget": 500}))
    with pytest.raises(ConfigError) as info:
        load_file(small)
    assert (
        "$.providers.p.models[1].thinking_budget: must be 0 (no extended thinking) or at least 1024"
        in str(info.value)
    )
    ok = [
        {"id": "c", "thinking_budget": 0, "reasoning_effort": "low"},
        {"id": "d", "thinking_budget": 1024},
        {"id": "e"},
    ]
    entries = load_file(write(tmp_path / "c.json", provider(*ok))).providers["p"].models
    assert [(m.reasoning_effort, m.thinking_budget) for m in entries] == [
        ("low", 0),
        ("", 1024),
        ("", 0),
    ]


def test_zero_is_allowed_where_it_means_none(tmp_path: Path) -> None:
    path = write(tmp_path / "c.json", {"server": {"detach_grace": 0, "replay_buffer": 0}})
    config = load_file(path)
    assert (config.server.detach_grace, config.server.replay_buffer) == (0, 0)


def test_unknown_keys_are_logged_with_path_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="crush_trio.config")
    data = {
        "$schema": "https://example.invalid/crush.json",
        "options": {"lsp": {"go": {}}, "max_steps": 9},
        "providers": {"p": {"type": "echo", "disable": False}},
        "lsp": {},
    }
    config = load_file(write(tmp_path / "c.json", data))
    assert config.options.max_steps == 9
    messages = [r.getMessage() for r in caplog.records if r.name == "crush_trio.config"]
    assert sorted(m.split(": ")[1] for m in messages) == [
        "$.lsp",
        "$.options.lsp",
        "$.providers.p.disable",
    ]
    assert all(m.endswith("unknown key ignored") for m in messages)


# --- model selection ---------------------------------------------------------------------------


def openai(*models: str) -> ProviderConfig:
    return ProviderConfig(type="openai", models=[ModelEntry(m) for m in models])


def test_no_selection_and_no_provider_is_builtin_echo() -> None:
    config = Config(models=Models(small=None, large=None))
    assert config.resolve_model("large") == builtin_echo()


def test_small_falls_back_to_large() -> None:
    config = Config(providers={"p": openai("a", "b")}, models=Models(large=SelectedModel("p", "b")))
    assert config.resolve_model("small") == ("p", openai("a", "b"), ModelEntry("b"))


def test_no_selection_uses_first_providers_first_model() -> None:
    config = Config(providers={"first": openai("x", "y"), "second": openai("z")})
    assert config.resolve_model("large")[0::2] == ("first", ModelEntry("x"))
    assert config.resolve_model("small")[0::2] == ("first", ModelEntry("x"))


def test_no_selection_and_first_provider_without_models_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path / "c.json", {"providers": {"p": {"type": "openai"}}})
    with pytest.raises(ConfigError, match=r"\$\.providers\.p\.models: provider 'p' lists no"):
        load_file(path)


def test_configured_echo_provider_without_models_serves_the_echo_model(tmp_path: Path) -> None:
    path = write(tmp_path / "c.json", {"providers": {"slow": {"type": "echo", "delay_ms": 5}}})
    name, provider, model = load_file(path).resolve_model("large")
    assert (name, provider.delay_ms, model) == ("slow", 5, ModelEntry("echo"))


def test_selected_echo_needs_no_provider_entry() -> None:
    config = Config(models=Models(large=SelectedModel("echo", "slow-echo")))
    assert config.resolve_model("large") == (
        "echo",
        ProviderConfig(type="echo"),
        ModelEntry("slow-echo"),
    )


def test_provider_without_model_list_accepts_any_model_and_max_tokens_overrides() -> None:
    config = Config(
        providers={"p": ProviderConfig(type="anthropic")},
        models=Models(large=SelectedModel("p", "any-model", max_tokens=100)),
    )
    assert config.resolve_model("large")[2] == ModelEntry("any-model", default_max_tokens=100)


def test_selection_of_unknown_provider_is_an_error_at_load(tmp_path: Path) -> None:
    data = {
        "providers": {"local": {"type": "openai", "models": [{"id": "m"}]}},
        "models": {"large": {"provider": "remote", "model": "m"}},
    }
    path = write(tmp_path / "c.json", data)
    with pytest.raises(ConfigError) as info:
        load_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: $.models.large.provider: unknown provider 'remote'")
    assert "'local', 'echo'" in message


def test_selection_of_unlisted_model_is_an_error_at_load(tmp_path: Path) -> None:
    data = {
        "providers": {"local": {"type": "openai", "models": [{"id": "m"}]}},
        "models": {"small": {"provider": "local", "model": "other"}},
    }
    with pytest.raises(ConfigError, match=r"\$\.models\.small\.model: model 'other' is not in"):
        load_file(write(tmp_path / "c.json", data))


def test_resolve_model_on_a_built_config_raises_config_error() -> None:
    config = Config(models=Models(large=SelectedModel("ghost", "m")))
    with pytest.raises(ConfigError, match=r"^\$\.models\.large\.provider: unknown provider"):
        config.resolve_model("small")


# --- display -------------------------------------------------------------------------------------


def test_config_to_json_redacts_secrets_and_round_trips(tmp_path: Path) -> None:
    config = Config(
        providers={
            "p": ProviderConfig(
                type="openai",
                api_key="sk-1",
                extra_headers={"Authorization": "Bearer t"},
                models=[ModelEntry("m")],
            ),
            "q": ProviderConfig(type="echo"),
        }
    )
    data = config_to_json(config)
    assert data["providers"]["p"]["api_key"] == "***"
    assert data["providers"]["p"]["extra_headers"] == {"Authorization": "***"}
    assert data["providers"]["q"]["api_key"] == ""
    assert "sk-1" not in orjson.dumps(data).decode()
    # The shape is the file format: it loads back (secrets aside).
    reloaded = load_file(write(tmp_path / "c.json", data))
    assert reloaded.providers["q"] == config.providers["q"]
    assert reloaded.server == config.server
