// Streaming command output and background jobs (docs/tools.md, docs/protocol.md §6.2).
//
// `tool_output` events are lossy pieces of a running command's output. This panel shows, for
// the open session, the live output of each `bash` call until its tool result arrives (the
// result is the record; the live view is then dropped), and the workspace's background jobs
// (`GET .../agent`, field `jobs`) with their latest output. A piece that does not follow what
// the panel holds (a missed piece, `dropped` bytes) is marked as a hole; the tool result or
// `job_output` has the whole output. All text goes in through textContent (dom.js).

import { api } from "./api.js";
import { clear, h } from "./dom.js";

/** Characters of live output kept per command in the page (older text is cut). */
export const LIVE_OUTPUT_CHARS = 64 * 1024;
/** Labels of the job states. */
const JOB_STATES = { running: "running", exited: "exited", killed: "killed" };

function keep(text) {
  return text.length > LIVE_OUTPUT_CHARS ? text.slice(text.length - LIVE_OUTPUT_CHARS) : text;
}

class LiveOutput {
  constructor(key, label) {
    this.key = key;
    this.label = label;
    this.text = "";
    this.nextOffset = 0;
    this.pre = h("pre", { class: "live-output", tabindex: "0" });
    this.status = h("span", { class: "muted" });
    this.el = h("details", { class: "live-command", open: true },
      h("summary", {}, h("code", { text: label }), " ", this.status),
      this.pre);
  }

  add(piece) {
    let hole = piece.offset > this.nextOffset;
    this.text = keep(this.text + (hole ? "\n[… output missed …]\n" : "") + piece.text);
    this.nextOffset = piece.offset + new TextEncoder().encode(piece.text).length;
    if (piece.dropped) {
      this.text = keep(`${this.text}\n[… ${piece.dropped} bytes not streamed …]\n`);
      this.nextOffset += piece.dropped;
      hole = true;
    }
    const atEnd = this.pre.scrollTop + this.pre.clientHeight >= this.pre.scrollHeight - 4;
    this.pre.textContent = this.text;
    if (atEnd) this.pre.scrollTop = this.pre.scrollHeight;
    return hole;
  }
}

/** The panel of running commands and background jobs of one workspace. */
export class JobsPanel {
  /**
   * @param {HTMLElement} anchor the panel is inserted before this element
   */
  constructor(anchor) {
    this.wid = null;
    this.session = null;
    this.commands = new Map(); // tool_call_id -> LiveOutput (the open session's bash calls)
    this.jobOutputs = new Map(); // job_id -> LiveOutput
    this.jobs = [];
    this.refreshing = null;
    this.commandList = h("div", { class: "live-commands" });
    this.jobList = h("ul", { class: "job-list", "aria-label": "Background jobs" });
    this.jobsHead = h("h3", { text: "Background jobs" });
    this.el = h("section", { id: "jobs", class: "jobs-panel", "aria-label": "Running commands and background jobs", hidden: true },
      this.commandList, this.jobsHead, this.jobList);
    anchor.before(this.el);
  }

  /** A workspace was opened (or closed: null). */
  setWorkspace(wid) {
    this.wid = wid;
    this.commands.clear();
    this.jobOutputs.clear();
    this.jobs = [];
    this.render();
    this.refresh();
  }

  /** The open session changed: live commands of other sessions are not shown. */
  setSession(sid) {
    this.session = sid;
    this.commands.clear();
    this.render();
  }

  /** Re-read the job list (after a connect, a gap, or a job that started or ended). */
  refresh() {
    if (!this.wid || this.refreshing) return;
    const wid = this.wid;
    this.refreshing = api.agentInfo(wid).then((info) => {
      if (wid !== this.wid) return;
      this.jobs = Array.isArray(info.jobs) ? info.jobs : [];
      this.render();
    }).catch(() => {}).finally(() => { this.refreshing = null; });
  }

  /** A `tool_output` event. */
  onOutput(piece) {
    if (piece.job_id) {
      let view = this.jobOutputs.get(piece.job_id);
      if (!view) {
        view = new LiveOutput(piece.job_id, piece.job_id);
        this.jobOutputs.set(piece.job_id, view);
      }
      view.add(piece);
      if (piece.done || !this.jobs.some((j) => j.id === piece.job_id)) this.refresh();
      this.render();
      return;
    }
    if (piece.session_id !== this.session) return;
    let view = this.commands.get(piece.tool_call_id);
    if (!view) {
      view = new LiveOutput(piece.tool_call_id, "bash (running)");
      this.commands.set(piece.tool_call_id, view);
      this.render();
    }
    view.add(piece);
  }

  /** A `message` event: a tool result ends the live view of its command. */
  onMessage(message) {
    let changed = false;
    for (const part of message.parts || []) {
      if (part.type === "tool_result" && this.commands.delete(part.data.tool_call_id)) changed = true;
      if (part.type === "tool_result" && part.data.name === "bash" && /background job/.test(part.data.content)) {
        this.refresh();
      }
    }
    if (changed) this.render();
  }

  render() {
    clear(this.commandList);
    for (const view of this.commands.values()) this.commandList.append(view.el);
    clear(this.jobList);
    for (const job of this.jobs) {
      const state = JOB_STATES[job.state] || job.state;
      const ended = job.state === "exited" ? ` (exit ${job.exit_code})` : "";
      const view = this.jobOutputs.get(job.id);
      this.jobList.append(h("li", { class: "job", dataset: { state: job.state } },
        h("div", { class: "job-head" },
          h("strong", { text: job.id }), " ",
          h("code", { text: job.command }), " ",
          h("span", { class: "job-state", text: `${state}${ended}` })),
        view ? view.pre : null));
    }
    this.jobsHead.hidden = this.jobs.length === 0;
    this.el.hidden = this.commands.size === 0 && this.jobs.length === 0;
  }
}
