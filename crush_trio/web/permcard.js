// What a permission card shows: the request as a person reads it (a command as a command, an
// edit or write as a diff, a fetch as its URL) and the risks it carries. Pure DOM building from
// the request's fields; every piece of text goes in as text (dom.js), never as markup.

import { diffView } from "./changes.js";
import { h } from "./dom.js";

/** Unchanged lines kept around a change in an edit's diff. */
const CONTEXT_LINES = 2;

/** The keyboard shortcut of each answer (document-wide while a card is shown). */
export const SHORTCUTS = { allow: "a", allow_session: "s", deny: "d" };

function splitLines(text) {
  if (!text) return [];
  const lines = String(text).split("\n");
  if (lines.length > 1 && lines[lines.length - 1] === "") lines.pop();
  return lines;
}

/**
 * A line diff from `before` to `after`, as unified-diff lines (` ` context, `-` removed, `+`
 * added): the common lines at both ends are kept as context (at most CONTEXT_LINES each), the
 * differing middle shown as removed then added lines.
 * @returns {string[]}
 */
export function lineDiff(before, after) {
  const a = splitLines(before);
  const b = splitLines(after);
  let head = 0;
  while (head < a.length && head < b.length && a[head] === b[head]) head++;
  let tail = 0;
  while (tail < a.length - head && tail < b.length - head && a[a.length - 1 - tail] === b[b.length - 1 - tail]) tail++;
  return [
    ...a.slice(Math.max(0, head - CONTEXT_LINES), head).map((t) => ` ${t}`),
    ...a.slice(head, a.length - tail).map((t) => `-${t}`),
    ...b.slice(head, b.length - tail).map((t) => `+${t}`),
    ...a.slice(a.length - tail, a.length - tail + CONTEXT_LINES).map((t) => ` ${t}`),
  ];
}

function isInside(path, root) {
  if (!path || !root) return true;
  const base = root.endsWith("/") ? root : `${root}/`;
  return path === root || path.startsWith(base);
}

/**
 * The risks a request carries, as short phrases a person can judge: network access, a path
 * outside the workspace, running a program.
 */
export function risksOf(req, workspacePath) {
  const p = req.params || {};
  const risks = [];
  if (typeof p.command === "string") risks.push("runs a program");
  if (p.network === true) risks.push("with network access");
  if (req.tool_name === "fetch") risks.push("reaches the network");
  if (!isInside(req.path, workspacePath)) risks.push("outside the workspace");
  return risks;
}

function filePathOf(req) {
  const p = req.params || {};
  return p.file_path || p.path || req.path || "";
}

/** The body of a card: what the tool will do, in the form a person reads it. */
export function requestView(req) {
  const p = req.params || {};
  if (typeof p.command === "string") {
    return h(
      "div",
      { class: "perm-body" },
      h("pre", { class: "perm-command", tabindex: "0", "aria-label": "Command" }, h("code", { text: `$ ${p.command}` })),
      p.background ? h("p", { class: "muted", text: "Runs in the background as a job." }) : null,
    );
  }
  if (req.tool_name === "fetch" || typeof p.url === "string") {
    return h(
      "div",
      { class: "perm-body" },
      h("p", {}, "GET ", h("code", { class: "perm-url", text: String(p.url || "") })),
      p.format ? h("p", { class: "muted", text: `as ${p.format}` }) : null,
    );
  }
  if (typeof p.old_string === "string" || typeof p.new_string === "string") {
    return h(
      "div",
      { class: "perm-body" },
      h("p", { class: "perm-file" }, h("code", { text: filePathOf(req) })),
      diffView(lineDiff(p.old_string || "", p.new_string || ""), `Change to ${filePathOf(req)}`),
    );
  }
  if (Array.isArray(p.edits)) {
    const parts = [h("p", { class: "perm-file" }, h("code", { text: filePathOf(req) }), ` — ${p.edits.length} edits, all or none`)];
    p.edits.forEach((e, i) => {
      parts.push(diffView(lineDiff(e?.old_string || "", e?.new_string || ""), `Edit ${i + 1} of ${filePathOf(req)}`));
    });
    return h("div", { class: "perm-body" }, parts);
  }
  if (typeof p.content === "string") {
    return h(
      "div",
      { class: "perm-body" },
      h("p", { class: "perm-file" }, h("code", { text: filePathOf(req) }), " — its new content"),
      diffView(lineDiff("", p.content), `New content of ${filePathOf(req)}`),
    );
  }
  const json = Object.keys(p).length ? JSON.stringify(p, null, 2) : "";
  return json ? h("pre", { class: "permission-params", tabindex: "0", text: json }) : null;
}

/** Whether a key press should answer a card: not while typing in a field. */
export function isShortcutTarget(ev) {
  if (ev.altKey || ev.ctrlKey || ev.metaKey || ev.isComposing) return false;
  const el = ev.target;
  if (!el || !el.closest) return true;
  return !el.closest("input, textarea, select, [contenteditable]");
}

/** The answer a key stands for, or null. */
export function answerForKey(key) {
  const k = String(key || "").toLowerCase();
  for (const [action, shortcut] of Object.entries(SHORTCUTS)) if (shortcut === k) return action;
  return null;
}
