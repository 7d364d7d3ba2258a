// Rendering of messages (PROTOCOL §4) into DOM nodes. Pure functions of the data they are given,
// plus a little view state (which reasoning blocks are open) that survives re-renders while a
// message streams.

import { h, shortTime } from "./dom.js";
import { renderMarkdown } from "./markdown.js";

const FINISH_LABELS = {
  end_turn: "Finished",
  max_tokens: "Stopped: the reply reached the token limit",
  tool_use: "Called tools",
  canceled: "Cancelled",
  error: "Failed",
};

/** Tool results by tool_call id, collected from tool messages. */
export function collectResults(messages) {
  const results = new Map();
  for (const msg of messages) {
    for (const part of msg.parts || []) {
      if (part.type === "tool_result") results.set(part.data.tool_call_id, part.data);
    }
  }
  return results;
}

/** Text a screen reader or a copy should get for a message: its text parts. */
export function messageText(msg) {
  return (msg.parts || [])
    .filter((p) => p.type === "text")
    .map((p) => p.data.text)
    .join("");
}

/**
 * Render one message.
 * @param {object} msg a Message
 * @param {{results: Map, calls: Set<string>, toggles: Map<string, boolean>}} ctx tool results
 *   by call id, every tool call id shown in the conversation, and the open/closed state the
 *   reader chose for reasoning and tool blocks (kept across re-renders while a message streams).
 * @returns {HTMLElement}
 */
export function renderMessage(msg, ctx) {
  const parts = msg.parts || [];
  const finish = parts.find((p) => p.type === "finish")?.data;
  const streaming = msg.role === "assistant" && !finish;
  const el = h("article", {
    class: `message role-${msg.role}${streaming ? " streaming" : ""}`,
    dataset: { messageId: msg.id, role: msg.role },
    "aria-busy": streaming ? "true" : "false",
  });

  if (msg.role === "tool") {
    // Results are shown under their calls; only orphans (no call in view) are shown here.
    const orphans = parts.filter((p) => p.type === "tool_result" && !ctx.calls.has(p.data.tool_call_id));
    if (!orphans.length) {
      el.hidden = true;
      return el;
    }
    el.append(header("Tool results", msg));
    for (const part of orphans) el.append(toolResult(part.data));
    return el;
  }

  const who = msg.role === "user" ? "You" : msg.role === "assistant" ? "Assistant" : "System";
  el.append(header(who, msg));
  const body = h("div", { class: "message-body" });
  el.append(body);

  parts.forEach((part, index) => {
    const d = part.data || {};
    switch (part.type) {
      case "text":
        if (msg.role === "user") body.append(h("div", { class: "user-text", text: d.text }));
        else body.append(h("div", { class: "markdown" }, renderMarkdown(d.text)));
        break;
      case "reasoning":
        body.append(reasoning(msg, index, d, ctx.toggles));
        break;
      case "tool_call":
        body.append(toolCall(d, ctx.results.get(d.id), finish, ctx.toggles));
        break;
      case "tool_result":
        body.append(toolResult(d));
        break;
      case "finish":
        body.append(finishLine(d));
        break;
      default:
        break;
    }
  });
  if (streaming) body.append(h("span", { class: "typing", "aria-hidden": "true", text: "…" }));
  return el;
}

function header(who, msg) {
  const bits = [h("span", { class: "who", text: who })];
  if (msg.role === "assistant" && msg.model) bits.push(h("span", { class: "model", text: msg.model }));
  bits.push(h("time", { class: "when", datetime: new Date((msg.created_at || 0) * 1000).toISOString(), text: shortTime(msg.created_at) }));
  return h("header", { class: "message-head" }, bits);
}

/** Remember the reader's choice when a <details> is opened or closed. */
function remember(details, key, toggles) {
  const initial = details.open;
  // Creating an open <details> fires a "toggle" too: that one is not a choice of the reader.
  details.addEventListener("toggle", () => {
    if (details.open === initial && !toggles.has(key)) return;
    toggles.set(key, details.open);
  });
}

function reasoning(msg, index, d, toggles) {
  const key = `reasoning:${msg.id}:${index}`;
  const details = h("details", { class: "reasoning", open: toggles.get(key) ?? false });
  remember(details, key, toggles);
  const label = d.finished_at ? "Reasoning" : "Reasoning…";
  details.append(h("summary", { text: label }), h("div", { class: "reasoning-text", text: d.thinking }));
  return details;
}

function prettyJson(text) {
  if (!text) return "";
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

function toolCall(call, result, finish, toggles) {
  let status = "running";
  if (result) status = result.is_error ? "error" : "done";
  else if (!call.finished) status = "preparing";
  else if (finish && finish.reason !== "tool_use") status = "stopped";
  const labels = { running: "running", preparing: "preparing", done: "done", error: "error", stopped: "not run" };
  const details = h("details", {
    class: `tool-call status-${status}`,
    dataset: { toolCallId: call.id, status },
    open: toggles.get(`tool:${call.id}`) ?? (status === "error" || status === "running"),
  });
  remember(details, `tool:${call.id}`, toggles);
  details.append(
    h(
      "summary",
      {},
      h("span", { class: "tool-name", text: call.name }),
      h("span", { class: `badge badge-${status}`, text: labels[status] }),
    ),
    h("div", { class: "tool-section-label", text: "Input" }),
    h("pre", { class: "tool-input", tabindex: "0", text: prettyJson(call.input) }),
  );
  if (result) {
    details.append(
      h("div", { class: "tool-section-label", text: result.is_error ? "Error" : "Result" }),
      h("pre", { class: `tool-output${result.is_error ? " is-error" : ""}`, tabindex: "0", text: result.content }),
    );
  }
  return details;
}

function toolResult(result) {
  return h(
    "div",
    { class: `tool-result${result.is_error ? " is-error" : ""}`, dataset: { toolCallId: result.tool_call_id } },
    h("div", { class: "tool-section-label", text: `${result.name}${result.is_error ? " (error)" : ""}` }),
    h("pre", { tabindex: "0", text: result.content }),
  );
}

function finishLine(d) {
  const reason = d.reason || "end_turn";
  const el = h("div", {
    class: `finish finish-${reason}`,
    dataset: { reason },
    role: reason === "error" ? "alert" : null,
  });
  el.append(h("span", { class: "finish-label", text: FINISH_LABELS[reason] || reason }));
  if (d.message) el.append(h("span", { class: "finish-message", text: `: ${d.message}` }));
  if (d.details) el.append(h("pre", { class: "finish-details", text: d.details }));
  return el;
}
