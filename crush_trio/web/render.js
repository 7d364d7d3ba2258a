// Rendering of messages (PROTOCOL §4) into DOM nodes. Pure functions of the data they are given,
// plus a little view state (which reasoning blocks are open) that survives re-renders while a
// message streams.

import { h, shortTime } from "./dom.js";
import { MarkdownStream } from "./markdown.js";

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

/** The field of each part type that a `message_delta` appends to (docs/protocol.md). */
export const STREAMED_FIELD = { text: "text", reasoning: "thinking", tool_call: "input" };

/**
 * Render one message.
 * @param {object} msg a Message
 * @param {{results: Map, calls: Set<string>, toggles: Map<string, boolean>}} ctx tool results
 *   by call id, every tool call id shown in the conversation, and the open/closed state the
 *   reader chose for reasoning and tool blocks (kept across re-renders while a message streams).
 * @returns {HTMLElement}
 */
export function renderMessage(msg, ctx) {
  return new MessageView().update(msg, ctx);
}

/**
 * One message on the page, kept current as it streams at the cost of what changed.
 *
 * Everything but the streamed fields (text, reasoning, tool input) makes up the message's
 * *shell*: the parts, their types and other fields, the finish, the tool results shown. While the
 * shell stays the same, an update only touches the streamed fields: the Markdown of a text part
 * renders just its appended text (MarkdownStream), reasoning text grows in place, a tool input is
 * rewritten when it changed. A changed shell is built anew, reusing the text parts' Markdown.
 * Either way the element equals what `renderMessage` makes of the message.
 */
export class MessageView {
  constructor() {
    /** @type {HTMLElement|null} */
    this.el = null;
    this.key = null;
    /** What each part index shows of its streamed field: {md} | {node, value}. */
    this.slots = [];
  }

  /**
   * Show `msg`. A built anew element replaces the old one where that one is in the page.
   * @param {Array<{from: string, text: string}|undefined>} [hints] per part index, what was
   *   appended to its streamed field since it had the value `from` (see MarkdownStream.set)
   * @returns {HTMLElement} the message's element
   */
  update(msg, ctx, hints = []) {
    const key = shellKey(msg, ctx);
    if (key === this.key && this.el) {
      (msg.parts || []).forEach((part, index) => this.fill(index, part, hints[index]));
      return this.el;
    }
    const old = this.el;
    const oldSlots = this.slots;
    this.slots = [];
    this.el = this.build(msg, ctx, oldSlots, hints);
    this.key = key;
    if (old?.parentNode) old.replaceWith(this.el);
    return this.el;
  }

  /** Bring a part's streamed field up to date in place. */
  fill(index, part, hint) {
    const slot = this.slots[index];
    if (!slot) return;
    const d = part.data || {};
    if (slot.md) {
      slot.md.set(d.text, hint);
      return;
    }
    const value = String(d[STREAMED_FIELD[part.type]] ?? "");
    if (value === slot.value) return;
    if (part.type === "tool_call") {
      slot.node.textContent = prettyJson(value);
    } else if (slot.value && slot.node.firstChild && hint && hint.from === slot.value) {
      slot.node.firstChild.appendData(hint.text);
    } else if (slot.value && slot.node.firstChild && value.startsWith(slot.value)) {
      slot.node.firstChild.appendData(value.slice(slot.value.length));
    } else {
      slot.node.textContent = value;
    }
    slot.value = value;
  }

  build(msg, ctx, oldSlots, hints) {
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
          if (msg.role === "user") {
            const node = h("div", { class: "user-text", text: d.text });
            this.slots[index] = { node, value: String(d.text ?? "") };
            body.append(node);
          } else {
            const md = oldSlots[index]?.md || new MarkdownStream(h("div", { class: "markdown" }));
            md.set(d.text, hints[index]);
            this.slots[index] = { md };
            body.append(md.el);
          }
          break;
        case "reasoning": {
          const details = reasoning(msg, index, d, ctx.toggles);
          this.slots[index] = { node: details.querySelector(".reasoning-text"), value: String(d.thinking ?? "") };
          body.append(details);
          break;
        }
        case "tool_call": {
          const details = toolCall(d, ctx.results.get(d.id), finish, ctx.toggles);
          this.slots[index] = { node: details.querySelector(".tool-input"), value: String(d.input ?? "") };
          body.append(details);
          break;
        }
        case "tool_result":
          body.append(toolResult(d));
          break;
        case "finish":
          body.append(finishLine(d));
          break;
        case "binary":
          body.append(attachment(d));
          break;
        default:
          break;
      }
    });
    if (streaming) body.append(h("span", { class: "typing", "aria-hidden": "true", text: "…" }));
    return el;
  }
}

/** A file attached to a user message: the image itself, or the file's name. */
function attachment(d) {
  const name = String(d.path || "file").split("/").pop();
  const fig = h("figure", { class: "attachment", dataset: { path: d.path || "" } });
  if (/^image\/(png|jpeg|gif|webp)$/.test(d.mime_type || "")) {
    fig.append(h("img", { src: `data:${d.mime_type};base64,${d.data || ""}`, alt: name }));
  }
  fig.append(h("figcaption", { text: `📎 ${name}` }));
  return fig;
}

/** Everything that the rendering of `msg` depends on except its streamed fields. */
function shellKey(msg, ctx) {
  const parts = msg.parts || [];
  const bits = [msg.id, msg.role, msg.model || "", msg.created_at || 0];
  for (const part of parts) {
    const d = part.data || {};
    const field = STREAMED_FIELD[part.type];
    bits.push(part.type, field ? { ...d, [field]: null } : d);
    if (part.type === "tool_call") bits.push(ctx.results.get(d.id) ?? null);
    if (part.type === "tool_result") bits.push(ctx.calls.has(d.tool_call_id));
  }
  return JSON.stringify(bits);
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
