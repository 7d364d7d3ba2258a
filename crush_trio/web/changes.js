// The changes panel: what each run of the open session changed, its diff, and "Revert this run"
// (docs/protocol.md "Changes: diffs and undo by run"; docs/web.md "Changes panel"). Also the
// diff view of an edit/multiedit/write permission request.
//
// Every piece of text (paths, diffs, messages) goes in through textContent (dom.js): a diff of a
// hostile file can never become markup.

import { ApiError, request } from "./api.js";
import { clear, h } from "./dom.js";

/** Runs listed in the panel (the newest of the session). */
export const CHANGES_RUNS_SHOWN = 20;
/** Diff lines shown per file before "… more lines" (the server bounds the whole diff). */
export const DIFF_LINES_SHOWN = 400;

const enc = encodeURIComponent;

/** The lines of one file's section in a unified diff (`diff --git a/PATH b/PATH` to the next). */
export function fileSection(diffText, path) {
  const lines = diffText.split("\n");
  const out = [];
  let inside = false;
  const header = `diff --git a/${path} b/${path}`;
  for (const line of lines) {
    if (line.startsWith("diff --git ")) inside = line === header;
    if (inside) out.push(line);
  }
  return out;
}

/** A <pre> of diff lines, each line a span classed by its kind (+, -, @@, header). */
export function diffView(lines, label) {
  const pre = h("pre", { class: "diff", tabindex: "0", "aria-label": label });
  const shown = lines.slice(0, DIFF_LINES_SHOWN);
  for (const line of shown) {
    let kind = "ctx";
    if (line.startsWith("+++") || line.startsWith("---") || line.startsWith("diff --git") || line.startsWith("index ")) kind = "head";
    else if (line.startsWith("+")) kind = "add";
    else if (line.startsWith("-")) kind = "del";
    else if (line.startsWith("@@")) kind = "hunk";
    pre.append(h("span", { class: `diff-${kind}`, text: `${line}\n` }));
  }
  if (lines.length > shown.length) {
    pre.append(h("span", { class: "diff-head", text: `… ${lines.length - shown.length} more lines\n` }));
  }
  return pre;
}

/**
 * The panel under the session head: the session's runs that changed files, newest first.
 * `state()` gives the open workspace and session; `toast(message, kind)` reports errors.
 */
export class ChangesPanel {
  constructor(root, state, toast) {
    this.root = root;
    this.state = state;
    this.toast = toast;
    this.open = new Set(); // run ids whose file list is shown
    this.diffs = new Map(); // run id -> Diff, once fetched
    this.conflicts = new Map(); // run id -> files named by a 409
    this.runs = [];
    this.loading = null;
  }

  /** Read the session's latest runs again and redraw (coalesced while a read is in flight). */
  refresh() {
    if (this.loading) {
      this.loading.again = true;
      return this.loading.promise;
    }
    const entry = { again: false, promise: null };
    this.loading = entry;
    entry.promise = (async () => {
      try {
        do {
          entry.again = false;
          await this.load();
        } while (entry.again);
      } finally {
        this.loading = null;
      }
    })();
    return entry.promise;
  }

  async load() {
    const { wid, sid } = this.state();
    if (!wid || !sid) {
      this.runs = [];
      this.render();
      return;
    }
    try {
      const runs = await request(
        "GET",
        `/v1/workspaces/${enc(wid)}/runs?session_id=${enc(sid)}&limit=${CHANGES_RUNS_SHOWN}`,
      );
      const now = this.state();
      if (now.wid !== wid || now.sid !== sid) return;
      this.runs = runs.filter((r) => r.files && r.files.length);
    } catch {
      this.runs = []; // an older server without the route, or unreachable: no panel
    }
    this.render();
  }

  /** A `files_changed` event: the run's record is written at its end; refresh then. */
  onFilesChanged(event) {
    if (event.session_id === this.state().sid) this.diffs.delete(event.run_id);
  }

  render() {
    clear(this.root);
    this.root.hidden = this.runs.length === 0;
    if (!this.runs.length) return;
    this.root.append(h("h3", { class: "changes-title", text: "Changed files" }));
    const list = h("ol", { class: "changes-runs" });
    for (const run of this.runs) list.append(this.renderRun(run));
    this.root.append(list);
  }

  renderRun(run) {
    const expanded = this.open.has(run.run_id);
    const n = run.files.length;
    const li = h("li", { class: "changes-run", dataset: { runId: run.run_id } });
    const toggle = h("button", {
      type: "button",
      class: "changes-toggle",
      "aria-expanded": expanded ? "true" : "false",
      text: `Run ${run.run_id.slice(0, 8)}: ${n} file${n === 1 ? "" : "s"} changed`,
      onclick: () => {
        if (expanded) this.open.delete(run.run_id);
        else this.open.add(run.run_id);
        this.render();
      },
    });
    const revert = h("button", {
      type: "button",
      class: "danger changes-revert",
      text: "Revert this run",
      onclick: () => this.revert(run, false, revert),
    });
    li.append(h("div", { class: "changes-run-head" }, toggle, revert));
    const conflict = this.conflicts.get(run.run_id);
    if (conflict) {
      li.append(
        h(
          "div",
          { class: "changes-conflict", role: "alert" },
          h("p", { text: "These files changed after the run; reverting would overwrite them:" }),
          h("ul", {}, conflict.map((path) => h("li", { class: "changes-path", text: path }))),
          h("button", {
            type: "button",
            class: "danger",
            text: "Revert anyway",
            onclick: (ev) => this.revert(run, true, ev.currentTarget),
          }),
        ),
      );
    }
    if (expanded) {
      const files = h("ul", { class: "changes-files" });
      for (const f of run.files) {
        const counts = f.binary ? "binary" : `+${f.added} −${f.removed}`;
        files.append(
          h(
            "li",
            {},
            h("button", {
              type: "button",
              class: `changes-file status-${f.status}`,
              dataset: { path: f.path },
              text: `${f.status[0].toUpperCase()} ${f.path} (${counts})`,
              onclick: (ev) => this.showDiff(run, f, ev.currentTarget.parentElement),
            }),
          ),
        );
      }
      li.append(files);
    }
    return li;
  }

  async showDiff(run, file, where) {
    const old = where.querySelector("pre.diff, p.diff-note");
    if (old) {
      old.remove();
      return;
    }
    const { wid } = this.state();
    try {
      let diff = this.diffs.get(run.run_id);
      if (!diff) {
        diff = await request("GET", `/v1/workspaces/${enc(wid)}/runs/${enc(run.run_id)}/diff`);
        this.diffs.set(run.run_id, diff);
      }
      const lines = fileSection(diff.diff, file.path);
      if (file.binary) where.append(h("p", { class: "diff-note", text: "Binary file: not shown." }));
      else if (!lines.length) {
        where.append(h("p", { class: "diff-note", text: diff.truncated ? "Not shown: the diff was cut at the server's bound." : "No text change (mode only)." }));
      } else where.append(diffView(lines, `Diff of ${file.path}`));
    } catch (err) {
      this.toast(`Cannot load the diff: ${err.message}`, "error");
    }
  }

  async revert(run, force, button) {
    const { wid } = this.state();
    if (button) button.disabled = true;
    try {
      const result = await request(
        "POST",
        `/v1/workspaces/${enc(wid)}/runs/${enc(run.run_id)}/revert`,
        { force },
      );
      this.conflicts.delete(run.run_id);
      const n = result.files.length;
      this.toast(
        result.state === "done"
          ? `Reverted ${n} file${n === 1 ? "" : "s"} of run ${run.run_id.slice(0, 8)}.`
          : `Revert ${result.state}: ${result.error}`,
        result.state === "done" ? "info" : "error",
      );
      await this.refresh();
    } catch (err) {
      if (err instanceof ApiError && err.status === 409 && Array.isArray(err.data?.files)) {
        this.conflicts.set(run.run_id, err.data.files);
        this.render();
      } else {
        this.toast(`Cannot revert: ${err.message}`, "error");
      }
    } finally {
      if (button) button.disabled = false;
    }
  }
}
