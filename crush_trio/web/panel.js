// The side panel: the current session's tokens, cost and Summarize, the agent's state (model,
// sandbox, MCP servers, context files), and the places the plan, jobs and changes are shown.
// Rendering only; app.js owns the state and calls these with what changed.

import { clear, h } from "./dom.js";

const $ = (id) => document.getElementById(id);

/** `12,345` */
export function formatCount(n) {
  return Number(n || 0).toLocaleString("en-US");
}

/** `$0.0123`: cents and below keep four decimals, larger sums two. */
export function formatCost(cost) {
  const c = Number(cost || 0);
  return c >= 1 ? `$${c.toFixed(2)}` : `$${c.toFixed(4)}`;
}

/** The session's usage: tokens in and out, and what they cost. */
export function renderUsage(session) {
  const box = clear($("session-usage"));
  if (!session) {
    box.append(h("p", { class: "muted", text: "No session selected." }));
    return;
  }
  const dl = h("dl", { class: "facts" });
  const fact = (label, value, id) => dl.append(h("dt", { text: label }), h("dd", { id, text: value }));
  fact("Tokens in", formatCount(session.prompt_tokens), "usage-prompt-tokens");
  fact("Tokens out", formatCount(session.completion_tokens), "usage-completion-tokens");
  fact("Cost", formatCost(session.cost), "usage-cost");
  fact("Messages", formatCount(session.message_count), "usage-messages");
  box.append(dl);
}

/** The agent's state from `GET .../agent`: model, sandbox, MCP servers, context files. */
export function renderAgent(agent) {
  const box = clear($("agent-state"));
  if (!agent) {
    box.append(h("p", { class: "muted", text: "Open a workspace to see the agent." }));
    return;
  }
  const dl = h("dl", { class: "facts" });
  const fact = (label, ...value) => dl.append(h("dt", { text: label }), h("dd", {}, ...value));
  const m = agent.model || {};
  if (m.model) fact("Model", h("code", { text: `${m.provider}/${m.model}` }));
  const sb = agent.sandbox || {};
  fact(
    "Sandbox",
    sb.active
      ? `on${sb.network ? ", network allowed" : ", no network"}`
      : h("span", { class: "warn-text", text: `off: ${sb.reason || "every command asks"}` }),
  );
  box.append(dl);
  const mcp = Array.isArray(agent.mcp) ? agent.mcp : [];
  if (mcp.length) {
    const ul = h("ul", { class: "plain-list", "aria-label": "MCP servers" });
    for (const s of mcp) {
      const detail = s.state === "failed" && s.error ? `: ${s.error}` : s.state === "connected" ? ` (${(s.tools || []).length} tools)` : "";
      ul.append(h("li", { dataset: { state: s.state } }, h("code", { text: s.name }), ` ${s.state}${detail}`));
    }
    box.append(h("h3", { text: "MCP servers" }), ul);
  }
  const files = contextFilesOf(agent);
  if (files.loaded.length || files.skipped.length) {
    const ul = h("ul", { class: "plain-list", "aria-label": "Context files" });
    for (const f of files.loaded) ul.append(h("li", {}, h("code", { text: f.path }), ` ${formatCount(f.size)} bytes`));
    for (const f of files.skipped) ul.append(h("li", { class: "muted" }, h("code", { text: f.path }), ` skipped: ${f.reason}`));
    box.append(h("h3", { text: "Context files" }), ul);
  }
}

/** The context files of the agent info, whatever the exact field names (loaded and skipped). */
function contextFilesOf(agent) {
  const ctx = agent.context_files ?? agent.context ?? null;
  let loaded = [];
  let skipped = [];
  if (Array.isArray(ctx)) loaded = ctx;
  else if (ctx && typeof ctx === "object") {
    loaded = Array.isArray(ctx.loaded) ? ctx.loaded : Array.isArray(ctx.files) ? ctx.files : [];
    skipped = Array.isArray(ctx.skipped) ? ctx.skipped : [];
  }
  if (Array.isArray(agent.context_skipped)) skipped = agent.context_skipped;
  const norm = (f) => ({ path: String(f.path ?? f.name ?? ""), size: f.size ?? f.bytes ?? 0, reason: String(f.reason ?? f.why ?? "") });
  return { loaded: loaded.map(norm), skipped: skipped.map(norm) };
}

/** The Summarize button's state and the progress line under it. */
export function renderSummarize({ enabled, progress }) {
  $("summarize").disabled = !enabled;
  $("summarize-status").textContent = progress || "";
}

/**
 * The model picker: `choices` are `{value: "provider/model", label, title}`; the first is the
 * workspace's default (value ""). `selected` is the value to show.
 */
export function renderModelPicker(choices, selected) {
  const select = clear($("model-picker"));
  for (const c of choices) {
    select.append(h("option", { value: c.value, title: c.title || "", text: c.label }));
  }
  select.value = choices.some((c) => c.value === selected) ? selected : "";
  select.disabled = choices.length <= 1;
}

/**
 * The choices of the model picker from the providers list (`GET .../providers`): a list of
 * providers `{id, name, models: [{id, name, context_window, cost_per_1m_in, cost_per_1m_out}]}`,
 * or an object of them by id. The first choice is the workspace's default.
 */
export function modelChoices(providers, current) {
  const list = Array.isArray(providers) ? providers : providers && typeof providers === "object" ? Object.entries(providers).map(([id, p]) => ({ id, ...p })) : [];
  const def = current?.model ? `${current.provider}/${current.model}` : "";
  const choices = [{ value: "", label: def ? `Default (${def})` : "Default model", title: "The workspace's models.large" }];
  for (const p of list) {
    for (const m of Array.isArray(p.models) ? p.models : []) {
      const value = `${p.id}/${m.id}`;
      const facts = [];
      if (m.context_window) facts.push(`${formatCount(m.context_window)} tokens of context`);
      if (m.cost_per_1m_in || m.cost_per_1m_out) facts.push(`$${m.cost_per_1m_in || 0} in / $${m.cost_per_1m_out || 0} out per 1M tokens`);
      choices.push({ value, label: `${p.name || p.id} · ${m.name || m.id}`, title: facts.join("; ") });
    }
  }
  return choices;
}

/** Show or hide the side panel (a drawer in narrow windows). */
export function togglePanel(force) {
  const open = force ?? !document.body.classList.contains("panel-open");
  document.body.classList.toggle("panel-open", open);
  $("toggle-panel").setAttribute("aria-expanded", String(open));
}
