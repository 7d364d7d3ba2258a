// The crush_trio web client: one page driving a workspace's agent over the public protocol.
//
// Data flow (see docs/web.md):
//   * POST /v1/workspaces opens the workspace for this tab's client_id; the websocket
//     /v1/workspaces/{id}/ws carries every event and the page's commands.
//   * State is read with websocket commands (sessions.list, messages.list, runs.get), whose replies
//     arrive in order with the events, then kept current by events. Messages are keyed by id and
//     each `message` event carries the whole message, so applying an event twice, or a snapshot
//     after it, never duplicates text.
//   * The page asks for `message_delta` events (`deltas=1`): while a message streams, each append
//     carries its offset, so the page appends only text it does not have yet and re-reads the
//     messages when some is missing (applyDelta).
//   * Messages render at most once per animation frame, each at the cost of what changed
//     (MessageView, MarkdownStream), whether the change came as a delta or as a whole snapshot.
//   * After a reconnect the server replays events after the last seq seen; a `gap` (or a new
//     workspace id) makes the page re-read the open session over the socket.
//   * Commands go over the socket when it is open and over HTTP otherwise.

import { api, ApiError, httpCommand } from "./api.js";
import { EventStream } from "./connection.js";
import { clear, h, uuid } from "./dom.js";
import { Attention } from "./notify.js";
import { modelChoices, renderAgent, renderModelPicker, renderSummarize, renderUsage, togglePanel } from "./panel.js";
import { SHORTCUTS, answerForKey, isShortcutTarget, requestView, risksOf } from "./permcard.js";
import { MessageView, STREAMED_FIELD } from "./render.js";
import { JobsPanel } from "./jobs.js";
import { renderTodos } from "./todos.js";
import { ChangesPanel } from "./changes.js";

/** localStorage key of the recently opened workspace paths. */
const RECENT_KEY = "crush_trio.recent_workspaces";
/** How many recent workspaces are remembered. */
const RECENT_MAX = 8;
/** Sessions read per page for the sidebar (`GET .../sessions?limit=`), and per search. */
const SESSIONS_PAGE = 50;
/** Milliseconds of no typing before the session search asks the server. */
const SEARCH_DEBOUNCE_MS = 250;
/** localStorage key prefix of the model last chosen for a session (`...<session id>`). */
const MODEL_KEY = "crush_trio.model.";
/** Finished runs kept in the prompt status list (older ones are dropped on the next send). */
const FINISHED_RUNS_SHOWN = 5;
/** How long a delete button waits for its confirming second press (milliseconds). */
const DELETE_CONFIRM_MS = 4000;
/** How long a notice stays up (milliseconds). */
const TOAST_MS = 6000;
/** A conversation scrolled to within this many pixels of its end follows new text. */
const STICK_TO_BOTTOM_PX = 80;
/** Widest window (pixels) where the sessions panel is a drawer. */
const NARROW_PX = 800;

const TERMINAL = new Set(["completed", "failed", "cancelled"]);
const RUN_LABELS = {
  sending: "sending",
  queued: "queued",
  running: "running",
  completed: "completed",
  failed: "failed",
  cancelled: "cancelled",
};

const $ = (id) => document.getElementById(id);

/** A file's bytes as base64 (the `content` of an attachment). */
function readBase64(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result).replace(/^data:[^,]*,/, ""));
    reader.onerror = () => reject(reader.error || new Error("read failed"));
    reader.readAsDataURL(file);
  });
}

class App {
  constructor() {
    this.clientId = uuid();
    this.path = null;
    this.wid = null;
    this.stream = null;
    this.reopen = false;
    this.lastSeq = null;
    this.sessions = new Map();
    this.current = null;
    this.wantedSession = null;
    this.messages = new Map();
    /** The MessageView of each message on the page, by message id. */
    this.views = new Map();
    /** Per message id, the length (code points) of each part's streamed field, as far as known. */
    this.lengths = new Map();
    /** Messages to render at the next animation frame. */
    this.dirty = new Set();
    /**
     * Per message id and part index, what deltas appended since the last render: `{from, text}`
     * where `from` is the field's value before (lets the view skip comparing the whole text).
     */
    this.appended = new Map();
    this.frame = 0;
    this.rereading = false;
    this.results = new Map();
    this.callOwner = new Map();
    this.toggles = new Map();
    this.runs = new Map();
    this.changes = new ChangesPanel(
      $("changes"),
      () => ({ wid: this.wid, sid: this.current }),
      (message, kind) => this.toast(message, kind),
    );
    this.permissions = new Map();
    this.queued = [];
    /** Files attached to the next prompt: {file_name, mime_type, content (base64)}. */
    this.attachments = [];
    this.renaming = null;
    this.syncGen = 0;
    this.loadGen = 0;
    this.refreshing = { queue: null, runs: null };
    /** Asks for attention while the tab is hidden (title badge, notifications). */
    this.attention = new Attention();
    /** The agent info of the open workspace (`GET .../agent`), and the model picker's choices. */
    this.agent = null;
    this.modelChoices = [];
    this.sessionsCursor = null;
    this.sessionsMore = false;
    this.searchResults = null;
    this.searchText = "";
    $("session-search").value = "";
    /** Paging of the sidebar: the oldest session read so far, and whether older ones exist. */
    this.sessionsCursor = null;
    this.sessionsMore = false;
    /** The sidebar's search: its text, and the sessions the server found for it. */
    this.searchText = "";
    this.searchResults = null;
    this.searchTimer = 0;
    this.searchGen = 0;
    /** The session being summarized, and the progress line of its summary. */
    this.summarizing = null;
    this.summaryProgress = "";
    // Counters shown nowhere; for debugging in the console and for the end-to-end tests.
    this.stats = { connects: 0, resumes: 0, gaps: 0, resyncs: 0, deltas: 0, rereads: 0 };
    /** Streaming command output and background jobs (jobs.js); created once the page exists. */
    this.jobs = null;
  }

  // -- start-up ---------------------------------------------------------------------------------

  init() {
    $("trust-workspace").addEventListener("click", () => this.trustWorkspace());
    $("workspace-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.openWorkspace($("workspace-path").value);
    });
    $("new-session").addEventListener("click", () => this.createSession());
    $("prompt-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.sendPrompt();
    });
    $("prompt").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing && !ev.altKey) {
        ev.preventDefault();
        this.sendPrompt();
      }
    });
    $("attach").addEventListener("click", () => $("attach-input").click());
    $("attach-input").addEventListener("change", (ev) => {
      this.attachFiles([...ev.target.files]);
      ev.target.value = "";
    });
    $("prompt").addEventListener("paste", (ev) => {
      const files = [...(ev.clipboardData?.files || [])].filter((f) => f.type.startsWith("image/"));
      if (!files.length) return;
      ev.preventDefault();
      this.attachFiles(files);
    });
    $("cancel-run").addEventListener("click", () => this.cancelRun());
    $("clear-queue").addEventListener("click", () => this.clearQueue());
    $("reconnect-now").addEventListener("click", () => this.stream?.reconnectNow());
    $("toggle-sidebar").addEventListener("click", () => this.toggleSidebar());
    $("toggle-panel").addEventListener("click", () => togglePanel());
    $("close-panel").addEventListener("click", () => {
      togglePanel(false);
      $("toggle-panel").focus();
    });
    $("summarize").addEventListener("click", () => this.summarize());
    $("session-search").addEventListener("input", (ev) => {
      clearTimeout(this.searchTimer);
      this.searchTimer = setTimeout(() => this.searchSessions(ev.target.value), SEARCH_DEBOUNCE_MS);
    });
    $("more-sessions").addEventListener("click", () => this.loadOlderSessions());
    $("model-picker").addEventListener("change", (ev) => {
      if (this.current) localStorage.setItem(MODEL_KEY + this.current, ev.target.value);
    });
    $("ask-notify").hidden = !this.attention.canAsk;
    $("ask-notify").addEventListener("click", async () => {
      const answer = await this.attention.ask();
      $("ask-notify").hidden = true;
      $("notify-text").textContent =
        answer === "granted"
          ? "While this tab is hidden you get a notification, and its title counts what waits for you."
          : "Notifications are off; while this tab is hidden its title counts what waits for you.";
    });
    document.addEventListener("keydown", (ev) => this.onShortcut(ev));
    document.addEventListener("keydown", (ev) => {
      if (ev.key === "Escape" && document.body.classList.contains("sidebar-open")) {
        this.toggleSidebar(false);
        $("toggle-sidebar").focus();
      } else if (ev.key === "Escape" && document.body.classList.contains("panel-open")) {
        togglePanel(false);
        $("toggle-panel").focus();
      }
    });
    window.addEventListener("online", () => this.stream?.reconnectNow());
    window.addEventListener("hashchange", () => this.fromHash());
    this.renderRecent();
    this.fromHash();
  }

  /** Open the workspace and session named in the URL fragment (#path=...&session=...). */
  fromHash() {
    const params = new URLSearchParams(location.hash.slice(1));
    const path = params.get("path");
    const session = params.get("session");
    if (path && path !== this.path) {
      this.wantedSession = session;
      this.openWorkspace(path);
    } else if (path && session && session !== this.current && this.sessions.has(session)) {
      this.selectSession(session);
    }
  }

  writeHash() {
    const params = new URLSearchParams();
    if (this.path) params.set("path", this.path);
    if (this.current) params.set("session", this.current);
    const hash = params.toString();
    if (location.hash.slice(1) !== hash) history.replaceState(null, "", `#${hash}`);
  }

  // -- recent workspaces ------------------------------------------------------------------------

  recent() {
    try {
      const list = JSON.parse(localStorage.getItem(RECENT_KEY) || "[]");
      return Array.isArray(list) ? list.filter((p) => typeof p === "string") : [];
    } catch {
      return [];
    }
  }

  remember(path) {
    const list = [path, ...this.recent().filter((p) => p !== path)].slice(0, RECENT_MAX);
    try {
      localStorage.setItem(RECENT_KEY, JSON.stringify(list));
    } catch {
      // Storage may be full or disabled; the list is a convenience only.
    }
    this.renderRecent();
  }

  forget(path) {
    try {
      localStorage.setItem(RECENT_KEY, JSON.stringify(this.recent().filter((p) => p !== path)));
    } catch {
      // as above
    }
    this.renderRecent();
  }

  renderRecent() {
    const list = this.recent();
    const ul = clear($("recent-list"));
    const datalist = clear($("recent-workspaces"));
    for (const path of list) {
      datalist.append(h("option", { value: path }));
      ul.append(
        h(
          "li",
          { class: path === this.path ? "current" : "" },
          h(
            "button",
            {
              type: "button",
              class: "recent-open",
              title: path,
              "aria-label": path,
              "aria-current": path === this.path ? "true" : null,
              onclick: () => this.openWorkspace(path),
            },
            h("span", { class: "recent-name", text: baseName(path) }),
            h("span", { class: "recent-path", text: path }),
          ),
          h("button", {
            type: "button",
            class: "icon-button small",
            "aria-label": `Forget ${path}`,
            title: "Forget",
            text: "×",
            onclick: () => this.forget(path),
          }),
        ),
      );
    }
    $("no-recent").hidden = list.length > 0;
  }

  // -- workspace and connection -----------------------------------------------------------------

  async openWorkspace(rawPath) {
    const path = String(rawPath || "").trim();
    if (!path) return;
    $("workspace-path").value = path;
    if (path === this.path && this.stream) {
      this.stream.reconnectNow();
      return;
    }
    this.setConnection("connecting", "Opening workspace…");
    let info;
    try {
      info = await this.openOnServer(path);
    } catch (err) {
      if (this.stream?.open) this.setConnection("open", "Connected");
      else this.setConnection("idle", "Not connected");
      this.toast(`Cannot open ${path}: ${err.message}`, "error");
      return;
    }
    if (this.stream) {
      this.stream.stop();
      this.stream = null;
    }
    if (this.wid && this.wid !== info.id) {
      // Let the previous workspace go (it shuts down when no other client holds it).
      api.releaseWorkspace(this.wid, this.clientId).catch(() => {});
    }
    const wantedSession = this.wantedSession;
    this.resetWorkspaceView();
    this.wantedSession = wantedSession;
    this.wid = info.id;
    this.path = info.path;
    this.jobsPanel().setWorkspace(info.id);
    $("workspace-path").value = info.path;
    this.renderTrust(info);
    document.title = `${baseName(info.path)} · crush_trio`;
    this.remember(info.path);
    this.writeHash();
    this.setEnabled(true);
    this.renderSessions();
    this.renderSessionHead();
    this.showModel();
    this.reopen = false;
    const stream = new EventStream({
      prepare: () => this.prepareStream(),
      onFrame: (frame) => {
        if (this.stream === stream) this.onFrame(frame);
      },
      onState: (state, detail) => {
        if (this.stream === stream) this.onStreamState(state, detail);
      },
    });
    this.stream = stream;
    stream.start();
    $("prompt").focus();
  }

  showModel() {
    const wid = this.wid;
    api
      .agentInfo(wid)
      .then((agent) => {
        if (wid !== this.wid) return;
        this.agent = agent;
        const m = agent.model || {};
        $("model-name").textContent = m.model ? `model: ${m.provider}/${m.model}` : "";
        renderAgent(agent);
        return api.providers(wid).then(
          (providers) => providers,
          () => [],
        );
      })
      .then((providers) => {
        if (wid !== this.wid || providers === undefined) return;
        this.modelChoices = modelChoices(providers, this.agent?.model);
        this.renderModelPicker();
      })
      .catch(() => {});
  }

  renderModelPicker() {
    const saved = this.current ? localStorage.getItem(MODEL_KEY + this.current) || "" : "";
    renderModelPicker(this.modelChoices.length ? this.modelChoices : modelChoices([], this.agent?.model), saved);
  }

  /** Summarize the current session (the button in the side panel). */
  async summarize() {
    const sid = this.current;
    if (!sid || this.summarizing) return;
    this.summarizing = sid;
    this.summaryProgress = "Summarizing…";
    this.updateControls();
    try {
      await api.summarize(this.wid, sid);
      this.summaryProgress = "Summarized: the next prompt starts from the summary.";
      this.announce("Session summarized.");
    } catch (err) {
      this.summaryProgress = "";
      this.toast(`Cannot summarize: ${err.message}`, "error");
    } finally {
      this.summarizing = null;
      this.updateControls();
    }
  }

  /** A, S or D answers the oldest permission card (not while typing in a field). */
  onShortcut(ev) {
    if (!this.permissions.size || !isShortcutTarget(ev)) return;
    const action = answerForKey(ev.key);
    if (!action) return;
    const card = $("permissions").querySelector(".permission");
    if (!card) return;
    ev.preventDefault();
    this.grant(card.dataset.permissionId, action, card);
  }

  /**
   * The trust bar: shown when the workspace is untrusted and its own crush.json set keys that
   * were ignored for that reason (the server's `warnings`), with a button that trusts it.
   */
  renderTrust(info) {
    const warnings = Array.isArray(info?.warnings) ? info.warnings : [];
    const ignored = warnings.filter((w) => /untrusted workspace/.test(w));
    const bar = $("trust-bar");
    bar.hidden = !info || info.trusted || ignored.length === 0;
    if (bar.hidden) return;
    $("trust-summary").textContent =
      `${ignored.length} setting(s) of its own crush.json were ignored (providers, environment ` +
      "variables, pre-approved tools and an outside data directory need trust).";
    const list = $("trust-warnings");
    clear(list);
    for (const line of ignored) list.append(h("li", {}, line));
  }

  async trustWorkspace() {
    const wid = this.wid;
    if (!wid) return;
    const ok = window.confirm(
      `Trust ${this.path}? Its crush.json may then choose where model requests go (with your ` +
        "API keys), read environment variables and pre-approve tools. Trust only projects you " +
        "wrote or checked.",
    );
    if (!ok) return;
    try {
      const result = await api.setTrust(wid, true);
      if (wid !== this.wid) return;
      this.renderTrust(result.workspace);
      this.showModel();
      this.toast(`Trusted: ${this.path} (saved in ${result.file})`, "info");
    } catch (err) {
      this.toast(`Cannot trust the workspace: ${err.message}`, "error");
    }
  }

  async openOnServer(path) {
    try {
      return await api.openWorkspace(path, this.clientId);
    } catch (err) {
      if (err instanceof ApiError && err.status === 409 && /retired/i.test(err.message)) {
        // This tab's client id was retired: continue as a new client.
        this.clientId = uuid();
        return api.openWorkspace(path, this.clientId);
      }
      throw err;
    }
  }

  /** Before each (re)connect: renew the hold and build the stream URL with the resume point. */
  async prepareStream() {
    if (this.reopen) {
      const info = await this.openOnServer(this.path);
      if (info.id !== this.wid) {
        // A different workspace instance (the server restarted): nothing held is current.
        this.wid = info.id;
        this.lastSeq = null;
      }
    }
    this.reopen = true;
    // deltas=1: appends to a streaming message come as message_delta events; batch=1: the
    // events written together come in one frame (docs/protocol.md §6.1, §6.6).
    const query = new URLSearchParams({ client_id: this.clientId, deltas: "1", batch: "1" });
    if (this.lastSeq !== null) query.set("since", String(this.lastSeq));
    return `/v1/workspaces/${encodeURIComponent(this.wid)}/ws?${query}`;
  }

  onStreamState(state, detail = {}) {
    const button = $("reconnect-now");
    button.hidden = state !== "reconnecting" || !detail.delay;
    if (state === "open") this.setConnection("open", "Connected");
    else if (state === "connecting") this.setConnection("connecting", "Connecting…");
    else if (state === "reconnecting") {
      const secs = detail.delay ? ` in ${Math.max(1, Math.round(detail.delay / 1000))}s` : "…";
      this.setConnection("reconnecting", `Reconnecting${secs}`, detail.reason);
    } else if (state === "unauthorized") {
      this.setConnection("unauthorized", "Not logged in");
      this.toast(
        "Not logged in: open the URL printed by 'crush-trio serve' (it ends in ?token=...).",
        "error",
      );
    } else this.setConnection("idle", "Not connected");
  }

  setConnection(state, text, why = "") {
    const el = $("connection");
    el.dataset.state = state;
    $("connection-text").textContent = text;
    el.title = why ? `Last disconnect: ${why}` : "";
  }

  /** Every frame of the stream except command replies. */
  onFrame(frame) {
    switch (frame.type) {
      case "hello":
        this.stats.connects += 1;
        if (this.lastSeq === null) {
          // A fresh stream: start from now and read the state.
          this.lastSeq = frame.seq;
          this.resync();
        } else {
          // Resuming: the missed events follow (or a gap frame when they are gone).
          this.stats.resumes += 1;
        }
        return;
      case "gap":
        this.stats.gaps += 1;
        this.lastSeq = Math.max(this.lastSeq ?? 0, frame.payload?.to_seq ?? 0);
        this.resync();
        return;
      case "error":
        console.warn("server:", frame.message);
        return;
      default:
        break;
    }
    if (typeof frame.seq === "number") {
      if (this.lastSeq !== null && frame.seq <= this.lastSeq) return; // already applied
      this.lastSeq = frame.seq;
    }
    const envelope = frame.payload || {};
    try {
      this.applyEvent(frame.type, envelope.type, envelope.payload || {});
    } catch (err) {
      console.error("cannot apply event", frame, err);
    }
  }

  /** Send a command: over the socket when it is open, else over HTTP. */
  async call(method, params = {}) {
    if (this.stream?.open) {
      try {
        return await this.stream.command(method, params);
      } catch (err) {
        if (!(err instanceof ApiError) || err.status !== 0) throw err;
        // The socket closed before the reply: ask again over HTTP.
      }
    }
    if (!this.wid) throw new ApiError(0, "no workspace is open");
    return httpCommand(this.wid, method, params);
  }

  /** Re-read sessions and the open session's messages (after a fresh connect or a gap). */
  async resync() {
    const gen = ++this.syncGen;
    this.stats.resyncs += 1;
    try {
      // The newest page only: a workspace may have thousands of sessions.
      const sessions = await api.sessionsPage(this.wid, { limit: SESSIONS_PAGE });
      if (gen !== this.syncGen) return;
      this.sessions = new Map(sessions.map((s) => [s.id, s]));
      this.sessionsCursor = sessions.length ? sessions[sessions.length - 1].id : null;
      this.sessionsMore = sessions.length === SESSIONS_PAGE;
      for (const sid of [this.current, this.wantedSession]) {
        // The open (or bookmarked) session may be older than the first page.
        if (sid && !this.sessions.has(sid)) {
          try {
            const s = await api.session(this.wid, sid);
            if (gen !== this.syncGen) return;
            this.sessions.set(s.id, s);
          } catch {
            // Deleted meanwhile: left out.
          }
        }
      }
      // Requests asked before this page connected (or during a gap) are still answerable.
      const pending = await api.pendingPermissions(this.wid);
      if (gen !== this.syncGen) return;
      this.permissions = new Map(pending.map((p) => [p.id, p]));
      this.renderPermissions();
      this.renderSessions();
      this.renderSessionHead();
      let target = this.current;
      if (target && !this.sessions.has(target)) target = null;
      if (!target && this.wantedSession && this.sessions.has(this.wantedSession)) {
        target = this.wantedSession;
      }
      this.wantedSession = null;
      if (!target) {
        const newest = [...this.sessions.values()].sort(byNewest)[0];
        target = newest ? newest.id : null;
      }
      if (target !== this.current) {
        await this.selectSession(target);
        return;
      }
      if (target) {
        const messages = await this.call("messages.list", { session_id: target });
        if (gen !== this.syncGen || target !== this.current) return;
        this.replaceMessages(messages);
      }
      this.updateControls();
      this.refreshQueue();
      this.refreshRuns();
      this.jobsPanel().refresh();
    } catch (err) {
      if (gen === this.syncGen) this.toast(`Cannot load the workspace: ${err.message}`, "error");
    }
  }

  // -- events -----------------------------------------------------------------------------------

  applyEvent(type, kind, obj) {
    switch (type) {
      case "session":
        this.onSession(kind, obj);
        break;
      case "message":
        this.jobsPanel().onMessage(obj);
        if (obj.session_id !== this.current) return;
        if (kind === "deleted") this.removeMessage(obj.id);
        else {
          const isNew = !this.messages.has(obj.id);
          this.upsertMessage(obj);
          if (isNew && obj.role === "user") {
            // A queued prompt of this session started: statuses and the queue changed.
            this.refreshQueue();
            this.refreshRuns();
          }
        }
        break;
      case "message_delta":
        this.applyDelta(obj);
        break;
      case "run_complete":
        this.onRunComplete(obj);
        if (obj.session_id === this.current) this.changes.refresh();
        break;
      case "files_changed":
        this.changes.onFilesChanged(obj);
        break;
      case "agent_event":
        if (obj.type === "error" && obj.session_id === this.current && !this.runs.has(obj.run_id)) {
          this.toast(`A run failed: ${agentText(obj)}`, "error");
        } else if (obj.type === "retry" && obj.session_id === this.current) {
          this.announce(agentText(obj));
        } else if (obj.type === "summarize" && obj.session_id === this.current) {
          this.summaryProgress = obj.progress || agentText(obj);
          this.updateControls();
        } else if (obj.type === "mcp") {
          this.showModel();
        }
        break;
      case "tool_output":
        this.jobsPanel().onOutput(obj);
        break;
      case "permission_request":
        this.permissions.set(obj.id, obj);
        this.renderPermissions();
        this.announce(`Permission requested: ${obj.tool_name}`);
        this.attention.need(`${obj.tool_name} asks to ${obj.action}: ${obj.description || obj.path}`, obj.id);
        break;
      case "permission_notification":
        for (const [id, req] of this.permissions) {
          if (id === obj.id || (obj.tool_call_id && req.tool_call_id === obj.tool_call_id)) {
            this.permissions.delete(id);
          }
        }
        this.renderPermissions();
        break;
      default:
        break;
    }
  }

  onSession(kind, session) {
    if (kind === "deleted") {
      this.sessions.delete(session.id);
      if (session.id === this.current) {
        const next = [...this.sessions.values()].sort(byNewest)[0];
        this.selectSession(next ? next.id : null);
      }
      this.renderSessions();
      return;
    }
    const old = this.sessions.get(session.id);
    const merged = { ...old, ...session };
    if (session.is_busy === undefined && old) merged.is_busy = old.is_busy;
    this.sessions.set(session.id, merged);
    this.renderSessions();
    if (session.id === this.current) {
      this.renderSessionHead();
      renderUsage(merged);
      this.updateControls();
      if (old && old.is_busy !== merged.is_busy) {
        this.refreshQueue();
        this.refreshRuns();
      }
    }
  }

  onRunComplete(done) {
    const run = this.runs.get(done.run_id);
    if (run) {
      run.status = done.cancelled ? "cancelled" : done.error ? "failed" : "completed";
      run.error = done.error || "";
      this.renderRuns();
      if (run.status === "completed") this.announce("Reply finished.");
      if (run.status === "failed") this.announce(`Run failed: ${done.error}`);
    }
    if (done.error && !done.cancelled) this.attention.need(`A run failed: ${done.error}`, done.run_id);
    if (done.session_id === this.current) this.refreshQueue();
  }

  // -- sessions ---------------------------------------------------------------------------------

  async createSession() {
    if (!this.wid) return;
    try {
      const session = await this.call("sessions.create", { title: "" });
      this.onSession("created", session);
      await this.selectSession(session.id);
      $("prompt").focus();
      return session;
    } catch (err) {
      this.toast(`Cannot create a session: ${err.message}`, "error");
      return null;
    }
  }

  /** The running-commands and jobs panel, in the side panel. */
  jobsPanel() {
    if (!this.jobs) this.jobs = new JobsPanel($("jobs-anchor"));
    return this.jobs;
  }

  async selectSession(sid) {
    const gen = ++this.loadGen;
    this.current = sid;
    this.jobsPanel().setSession(sid);
    this.replaceMessages([]);
    this.queued = [];
    this.renderQueue();
    this.renderSessions();
    this.renderSessionHead();
    renderUsage(sid ? this.sessions.get(sid) : null);
    this.summaryProgress = "";
    this.renderModelPicker();
    this.renderRuns();
    this.changes.refresh();
    this.updateControls();
    this.writeHash();
    if (window.innerWidth < NARROW_PX) this.toggleSidebar(false);
    if (!sid) return;
    $("conversation").setAttribute("aria-busy", "true");
    try {
      const messages = await this.call("messages.list", { session_id: sid });
      if (gen !== this.loadGen) return;
      this.replaceMessages(messages);
    } catch (err) {
      if (gen === this.loadGen) this.toast(`Cannot load the session: ${err.message}`, "error");
    } finally {
      if (gen === this.loadGen) $("conversation").setAttribute("aria-busy", "false");
    }
    this.refreshQueue();
    this.refreshRuns();
  }

  async deleteSession(sid, button) {
    if (button.dataset.confirm !== "true") {
      const title = sessionTitle(this.sessions.get(sid));
      button.dataset.confirm = "true";
      button.textContent = "Delete?";
      button.setAttribute("aria-label", `Press again to delete session ${title}`);
      setTimeout(() => {
        if (button.isConnected) this.renderSessions();
      }, DELETE_CONFIRM_MS);
      return;
    }
    try {
      await api.deleteSession(this.wid, sid);
      this.onSession("deleted", { id: sid });
    } catch (err) {
      this.toast(`Cannot delete the session: ${err.message}`, "error");
      this.renderSessions();
    }
  }

  startRename(sid, li) {
    const session = this.sessions.get(sid);
    if (!session) return;
    const input = h("input", {
      type: "text",
      class: "rename-input",
      value: session.title || "",
      "aria-label": "New session title",
    });
    const form = h("form", { class: "rename-form" }, input);
    let done = false;
    const finish = async (save) => {
      if (done) return;
      done = true;
      this.renaming = null;
      const title = input.value.trim();
      if (save && title && title !== session.title) {
        try {
          const updated = await api.renameSession(this.wid, sid, title);
          this.onSession("updated", updated);
        } catch (err) {
          const unsupported = err.status === 404 || err.status === 405;
          this.toast(
            unsupported ? "This server cannot rename sessions." : `Cannot rename: ${err.message}`,
            "error",
          );
        }
      }
      this.renderSessions();
      const again = [...$("session-list").querySelectorAll(".session")].find(
        (item) => item.dataset.sessionId === sid,
      );
      again?.querySelector(".session-open")?.focus();
    };
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      finish(true);
    });
    input.addEventListener("keydown", (ev) => {
      if (ev.key === "Escape") {
        ev.preventDefault();
        finish(false);
      }
    });
    input.addEventListener("blur", () => finish(true));
    this.renaming = sid;
    clear(li).append(form);
    input.focus();
    input.select();
  }

  /** Ask the server for the sessions whose title contains `text` (the sidebar's search). */
  async searchSessions(text) {
    const q = String(text || "").trim();
    const gen = ++this.searchGen;
    this.searchText = q;
    if (!q || !this.wid) {
      this.searchResults = null;
      this.renderSessions();
      return;
    }
    try {
      const found = await api.sessionsPage(this.wid, { limit: SESSIONS_PAGE, q });
      if (gen !== this.searchGen) return;
      this.searchResults = found.map((s) => s.id);
      for (const s of found) if (!this.sessions.has(s.id)) this.sessions.set(s.id, s);
      this.renderSessions();
      this.announce(`${found.length} sessions found`);
    } catch (err) {
      if (gen === this.searchGen) this.toast(`Cannot search the sessions: ${err.message}`, "error");
    }
  }

  /** The next page of older sessions (the sidebar's *Show older sessions*). */
  async loadOlderSessions() {
    if (!this.wid || !this.sessionsCursor) return;
    const wid = this.wid;
    try {
      const page = await api.sessionsPage(wid, { limit: SESSIONS_PAGE, before: this.sessionsCursor });
      if (wid !== this.wid) return;
      for (const s of page) if (!this.sessions.has(s.id)) this.sessions.set(s.id, s);
      if (page.length) this.sessionsCursor = page[page.length - 1].id;
      this.sessionsMore = page.length === SESSIONS_PAGE;
      this.renderSessions();
    } catch (err) {
      this.toast(`Cannot load older sessions: ${err.message}`, "error");
    }
  }

  renderSessions() {
    // A rename in progress keeps its input; the list is redrawn when it ends.
    if (this.renaming) return;
    const ul = $("session-list");
    // Keep keyboard focus on the same control across the redraw.
    const active = ul.contains(document.activeElement) ? document.activeElement : null;
    const focusKey = active
      ? [active.closest(".session")?.dataset.sessionId, active.className.split(" ").pop()]
      : null;
    clear(ul);
    const shown = this.searchResults ? new Set(this.searchResults) : null;
    const sessions = [...this.sessions.values()].filter((s) => !shown || shown.has(s.id)).sort(byNewest);
    for (const s of sessions) {
      const title = sessionTitle(s);
      const li = h("li", {
        class: `session${s.id === this.current ? " current" : ""}`,
        dataset: { sessionId: s.id, busy: s.is_busy ? "true" : "false" },
      });
      li.append(
        h(
          "button",
          {
            type: "button",
            class: "session-open",
            "aria-current": s.id === this.current ? "true" : null,
            onclick: () => this.selectSession(s.id),
          },
          h("span", { class: "session-title", text: title }),
          h("span", { class: "busy-badge", text: s.is_busy ? "busy" : "idle" }),
        ),
        h("button", {
          type: "button",
          class: "icon-button small session-rename",
          "aria-label": `Rename session ${title}`,
          title: "Rename",
          text: "✎",
          onclick: () => this.startRename(s.id, li),
        }),
        h("button", {
          type: "button",
          class: "icon-button small session-delete",
          "aria-label": `Delete session ${title}`,
          title: "Delete",
          text: "✕",
          onclick: (ev) => this.deleteSession(s.id, ev.currentTarget),
        }),
      );
      ul.append(li);
    }
    $("no-sessions").hidden = sessions.length > 0 || !this.wid;
    $("no-sessions").textContent = shown
      ? `No session title contains “${this.searchText}”.`
      : "No sessions yet. Send a prompt to start one.";
    $("more-sessions").hidden = !this.sessionsMore || !!shown || !this.wid;
    $("session-search").disabled = !this.wid;
    if (focusKey) {
      const [sid, cls] = focusKey;
      const target = [...ul.querySelectorAll(".session")].find((li) => li.dataset.sessionId === sid);
      (target?.querySelector(`.${cls}`) || target?.querySelector(".session-open"))?.focus();
    }
  }

  renderSessionHead() {
    const s = this.current ? this.sessions.get(this.current) : null;
    $("session-title").textContent = s ? sessionTitle(s) : this.wid ? "New conversation" : "No session";
    const state = $("session-state");
    state.dataset.busy = s?.is_busy ? "true" : "false";
    state.textContent = s ? (s.is_busy ? "busy" : "idle") : "";
    renderTodos(s);
  }

  // -- messages ---------------------------------------------------------------------------------

  get renderContext() {
    return { results: this.results, calls: new Set(this.callOwner.keys()), toggles: this.toggles };
  }

  indexMessage(msg) {
    for (const part of msg.parts || []) {
      if (part.type === "tool_result") this.results.set(part.data.tool_call_id, part.data);
      if (part.type === "tool_call") this.callOwner.set(part.data.id, msg.id);
    }
  }

  /**
   * Show exactly `messages` (a fresh read of the open session). Messages already on the page keep
   * their view, so a re-read during a long reply renders only what it added.
   */
  replaceMessages(messages) {
    const box = $("conversation");
    const stick = this.nearBottom();
    const keep = new Set(messages.map((m) => m.id));
    for (const [id, view] of this.views) {
      if (keep.has(id)) continue;
      view.el?.remove();
      this.views.delete(id);
    }
    this.messages = new Map();
    this.lengths = new Map();
    this.appended = new Map();
    this.dirty.clear();
    this.results = new Map();
    this.callOwner = new Map();
    for (const msg of messages) {
      this.messages.set(msg.id, msg);
      this.indexMessage(msg);
    }
    const ctx = this.renderContext;
    let prev = $("empty-state");
    for (const msg of messages) {
      const el = this.viewOf(msg.id).update(msg, ctx);
      if (prev.nextSibling !== el) box.insertBefore(el, prev.nextSibling);
      prev = el;
    }
    $("empty-state").hidden = messages.length > 0 || !!this.current;
    if (stick || messages.length) this.scrollToBottom();
  }

  /** A whole message (a `message` event): it supersedes what the page assembled for it. */
  upsertMessage(msg) {
    this.messages.set(msg.id, msg);
    this.lengths.delete(msg.id);
    this.appended.delete(msg.id);
    this.indexMessage(msg);
    this.markDirty(msg.id);
    if (msg.role === "tool") {
      // Results show under their calls: re-render the messages that hold those calls.
      for (const part of msg.parts || []) {
        if (part.type !== "tool_result") continue;
        const owner = this.callOwner.get(part.data.tool_call_id);
        if (owner && this.messages.has(owner)) this.markDirty(owner);
      }
    }
  }

  /**
   * Apply a `message_delta` (docs/protocol.md, "Message deltas"): append to the part's streamed
   * field what the page does not have yet. The page knows the length of each field in code
   * points (`have`); a delta at `offset == have` is appended, one at `offset < have` adds only
   * its uncovered tail, and one at `offset > have` (text missing, after a dropped delta) or for
   * a message or part the page does not have makes it re-read the session's messages.
   */
  applyDelta(d) {
    if (d.session_id !== this.current) return;
    this.stats.deltas += 1;
    const msg = this.messages.get(d.message_id);
    const field = STREAMED_FIELD[d.part_type];
    if (!msg || !field || !Number.isInteger(d.part) || !Number.isInteger(d.offset)) {
      this.rereadMessages();
      return;
    }
    const parts = msg.parts || (msg.parts = []);
    if (d.part === parts.length && d.offset === 0) {
      parts.push(newPart(d));
      this.markDirty(msg.id);
    }
    const part = parts[d.part];
    if (!part || part.type !== d.part_type) {
      this.rereadMessages();
      return;
    }
    const data = part.data || (part.data = {});
    const value = String(data[field] ?? "");
    let lengths = this.lengths.get(msg.id);
    if (!lengths) this.lengths.set(msg.id, (lengths = []));
    const have = lengths[d.part] ?? codePoints(value);
    if (d.offset > have) {
      this.rereadMessages();
      return;
    }
    const text = dropCodePoints(String(d.text ?? ""), have - d.offset);
    lengths[d.part] = have + codePoints(text);
    if (!text) return;
    data[field] = value + text;
    let hints = this.appended.get(msg.id);
    if (!hints) this.appended.set(msg.id, (hints = []));
    if (hints[d.part]) hints[d.part].text += text;
    else hints[d.part] = { from: value, text };
    this.markDirty(msg.id);
  }

  /** Re-read the open session's messages (text went missing); one read at a time. */
  async rereadMessages() {
    const sid = this.current;
    if (!sid || this.rereading) return;
    this.rereading = true;
    this.stats.rereads += 1;
    const gen = this.syncGen;
    const load = this.loadGen;
    try {
      // Over the socket the reply comes after every event sent before it, so it holds the text
      // of the deltas skipped meanwhile; later deltas overlap it or continue it.
      const messages = await this.call("messages.list", { session_id: sid });
      if (gen === this.syncGen && load === this.loadGen && sid === this.current) {
        this.replaceMessages(messages);
      }
    } catch (err) {
      console.warn("cannot re-read the messages:", err.message);
    } finally {
      this.rereading = false;
    }
  }

  viewOf(id) {
    let view = this.views.get(id);
    if (!view) this.views.set(id, (view = new MessageView()));
    return view;
  }

  /** Render message `id` at the next animation frame. */
  markDirty(id) {
    this.dirty.add(id);
    if (!this.frame) this.frame = requestAnimationFrame(() => this.flushRender());
  }

  /**
   * Render the messages changed since the last frame, each once and at the cost of what changed
   * in it. Runs from requestAnimationFrame; calling it earlier renders at once.
   */
  flushRender() {
    if (this.frame) cancelAnimationFrame(this.frame);
    this.frame = 0;
    if (!this.dirty.size) return;
    const stick = this.nearBottom();
    const ctx = this.renderContext;
    const box = $("conversation");
    for (const id of this.dirty) {
      const msg = this.messages.get(id);
      if (!msg) continue;
      const el = this.viewOf(id).update(msg, ctx, this.appended.get(id));
      if (!el.parentNode) box.append(el);
    }
    this.dirty.clear();
    this.appended.clear();
    $("empty-state").hidden = true;
    if (stick) this.scrollToBottom();
  }

  removeMessage(id) {
    this.views.get(id)?.el?.remove();
    this.views.delete(id);
    this.messages.delete(id);
    this.lengths.delete(id);
    this.appended.delete(id);
    this.dirty.delete(id);
  }

  nearBottom() {
    const box = $("conversation");
    return box.scrollHeight - box.scrollTop - box.clientHeight < STICK_TO_BOTTOM_PX;
  }

  scrollToBottom() {
    const box = $("conversation");
    box.scrollTop = box.scrollHeight;
  }

  // -- prompting --------------------------------------------------------------------------------

  /** Read files (picked or pasted) and add them to the next prompt's attachments. */
  async attachFiles(files) {
    for (const file of files) {
      try {
        const content = await readBase64(file);
        const ext = (file.type.split("/")[1] || "bin").replace("jpeg", "jpg");
        const name = file.name && file.name !== "image.png" ? file.name : `pasted-${this.attachments.length + 1}.${ext}`;
        this.attachments.push({ file_name: name, mime_type: file.type || "", content });
      } catch (err) {
        this.toast(`Cannot read ${file.name || "the file"}: ${err.message}`, "error");
      }
    }
    this.renderAttachments();
  }

  renderAttachments() {
    const list = clear($("attachment-list"));
    list.hidden = !this.attachments.length;
    this.attachments.forEach((att, index) => {
      const remove = h("button", { type: "button", class: "remove-attachment", "aria-label": `Remove ${att.file_name}`, text: "×" });
      remove.addEventListener("click", () => {
        this.attachments.splice(index, 1);
        this.renderAttachments();
      });
      list.append(h("li", {}, h("span", { text: `📎 ${att.file_name}`, title: att.file_name }), remove));
    });
  }

  async sendPrompt() {
    const box = $("prompt");
    const text = box.value;
    const attachments = this.attachments;
    if (!text.trim() && !attachments.length) return;
    if (!this.wid) {
      this.toast("Open a workspace first.", "error");
      $("workspace-path").focus();
      return;
    }
    box.value = "";
    this.attachments = [];
    this.renderAttachments();
    const restore = () => {
      if (!box.value) box.value = text;
      if (!this.attachments.length) {
        this.attachments = attachments;
        this.renderAttachments();
      }
    };
    let sid = this.current;
    if (!sid) {
      const session = await this.createSession();
      if (!session) {
        restore();
        return;
      }
      sid = session.id;
    }
    this.pruneRuns();
    const run = { run_id: uuid(), session_id: sid, prompt: text, status: "sending", error: "" };
    this.runs.set(run.run_id, run);
    this.renderRuns();
    const model = $("model-picker").value;
    if (model) localStorage.setItem(MODEL_KEY + sid, model);
    try {
      const accepted = await this.call("agent.prompt", {
        session_id: sid,
        prompt: text,
        run_id: run.run_id,
        ...(model ? { model } : {}),
        ...(attachments.length ? { attachments } : {}),
      });
      if (!TERMINAL.has(run.status)) run.status = accepted.status;
    } catch (err) {
      if (err instanceof ApiError && err.status === 400 && /already used/.test(err.message)) {
        // The first try reached the server before the socket closed: the run exists.
        this.refreshRun(run);
      } else {
        run.status = "failed";
        run.error = err.message;
        restore();
        this.toast(`Prompt not sent: ${err.message}`, "error");
      }
    }
    this.renderRuns();
    this.refreshQueue();
  }

  async cancelRun() {
    if (!this.current) return;
    try {
      await this.call("agent.cancel", { session_id: this.current });
      this.announce("Cancelling the run.");
    } catch (err) {
      this.toast(`Cannot cancel: ${err.message}`, "error");
    }
  }

  async clearQueue() {
    if (!this.current) return;
    try {
      await this.call("agent.clear_queue", { session_id: this.current });
    } catch (err) {
      this.toast(`Cannot clear the queue: ${err.message}`, "error");
    }
    this.refreshQueue();
  }

  /** Re-read the open session's queued prompts (coalesced: one request at a time). */
  refreshQueue() {
    return this.coalesce("queue", async () => {
      const sid = this.current;
      if (!sid || !this.wid) {
        this.queued = [];
      } else {
        try {
          const list = await api.queuedPrompts(this.wid, sid);
          if (sid !== this.current) return;
          this.queued = Array.isArray(list) ? list : [];
        } catch {
          return;
        }
      }
      this.renderQueue();
    });
  }

  /** Re-read the status of this tab's unfinished runs in the open session. */
  refreshRuns() {
    return this.coalesce("runs", async () => {
      const pending = [...this.runs.values()].filter(
        (r) => r.session_id === this.current && !TERMINAL.has(r.status) && r.status !== "sending",
      );
      await Promise.all(pending.map((r) => this.refreshRun(r)));
    });
  }

  async refreshRun(run) {
    try {
      const record = await this.call("runs.get", { run_id: run.run_id });
      // A run_complete may have arrived meanwhile; it is authoritative.
      if (!TERMINAL.has(run.status)) {
        run.status = record.status;
        run.error = record.error || "";
      }
      this.renderRuns();
    } catch {
      // Unknown yet, or not reachable: the next event brings it.
    }
  }

  /** Run `fn` now, or once more after the run in flight when called meanwhile. */
  async coalesce(key, fn) {
    const slot = this.refreshing;
    if (slot[key]) {
      slot[key].again = true;
      return slot[key].promise;
    }
    const entry = { again: false, promise: null };
    slot[key] = entry;
    entry.promise = (async () => {
      try {
        do {
          entry.again = false;
          await fn();
        } while (entry.again);
      } finally {
        slot[key] = null;
      }
    })();
    return entry.promise;
  }

  pruneRuns() {
    const finished = [...this.runs.values()].filter((r) => TERMINAL.has(r.status));
    for (const run of finished.slice(0, Math.max(0, finished.length - FINISHED_RUNS_SHOWN + 1))) {
      this.runs.delete(run.run_id);
    }
  }

  renderRuns() {
    const ul = clear($("run-list"));
    for (const run of this.runs.values()) {
      if (run.session_id !== this.current) continue;
      const excerpt = run.prompt.length > 80 ? `${run.prompt.slice(0, 77)}…` : run.prompt;
      ul.append(
        h(
          "li",
          { class: `run status-${run.status}`, dataset: { runId: run.run_id, status: run.status } },
          h("span", { class: `badge badge-${run.status}`, text: RUN_LABELS[run.status] || run.status }),
          h("span", { class: "run-prompt", text: excerpt }),
          run.error ? h("span", { class: "run-error", text: run.error }) : null,
        ),
      );
    }
    this.updateControls();
  }

  renderQueue() {
    const n = this.queued.length;
    $("queue-bar").hidden = n === 0;
    $("queue-bar").dataset.count = String(n);
    $("queue-count").textContent = `${n} queued prompt${n === 1 ? "" : "s"}`;
    const ol = clear($("queue-list"));
    for (const text of this.queued) ol.append(h("li", { text }));
  }

  updateControls() {
    const open = !!this.wid;
    const s = this.current ? this.sessions.get(this.current) : null;
    const busy = !!s?.is_busy;
    const mine = [...this.runs.values()].some(
      (r) => r.session_id === this.current && (r.status === "running" || r.status === "queued"),
    );
    $("cancel-run").disabled = !open || !(busy || mine);
    renderSummarize({
      enabled: open && !!s && !busy && !mine && !this.summarizing && (s.message_count || 0) > 0,
      progress: this.summaryProgress,
    });
  }

  setEnabled(on) {
    for (const id of ["prompt", "send", "new-session", "attach"]) $(id).disabled = !on;
  }

  // -- permissions ------------------------------------------------------------------------------

  renderPermissions() {
    const box = clear($("permissions"));
    for (const req of this.permissions.values()) {
      const titleId = `perm-title-${req.id}`;
      const session = this.sessions.get(req.session_id);
      const card = h("div", {
        class: "permission",
        role: "group",
        "aria-labelledby": titleId,
        dataset: { permissionId: req.id, toolCallId: req.tool_call_id },
      });
      const facts = h("dl", { class: "permission-facts" });
      const fact = (label, value) => {
        if (value) facts.append(h("dt", { text: label }), h("dd", { text: value }));
      };
      fact("Action", req.action);
      fact("Path", req.path);
      fact("Session", session ? sessionTitle(session) : req.session_id);
      const risks = risksOf(req, this.path);
      const answer = (action) => this.grant(req.id, action, card);
      const first = box.children.length === 0;
      const key = (action) => (first ? SHORTCUTS[action].toUpperCase() : null);
      card.append(
        h("h3", { id: titleId, text: `Allow ${req.tool_name}?` }),
        risks.length ? h("p", { class: "permission-risks" }, h("strong", { text: "Risk: " }), risks.join(", ")) : null,
        req.description ? h("p", { class: "permission-description", text: req.description }) : null,
        requestView(req),
        facts,
        h(
          "div",
          { class: "permission-actions" },
          h("button", {
            type: "button",
            class: "primary",
            dataset: { action: "allow" },
            "aria-keyshortcuts": key("allow"),
            text: "Allow",
            onclick: () => answer("allow"),
          }),
          h("button", {
            type: "button",
            dataset: { action: "allow_session" },
            "aria-keyshortcuts": key("allow_session"),
            text: "Allow for session",
            // What the server remembers (docs/tools.md, "Permission scope").
            title:
              typeof req.params?.command === "string"
                ? "Run this exact command again in this session without asking"
                : "Allow this tool on this path again in this session without asking",
            onclick: () => answer("allow_session"),
          }),
          h("button", {
            type: "button",
            class: "danger",
            dataset: { action: "deny" },
            "aria-keyshortcuts": key("deny"),
            text: "Deny",
            onclick: () => answer("deny"),
          }),
          first ? h("span", { class: "muted shortcut-hint", text: "Keys: A allow, S for session, D deny" }) : null,
        ),
      );
      box.append(card);
    }
    box.hidden = this.permissions.size === 0;
  }

  async grant(id, action, card) {
    for (const b of card.querySelectorAll("button")) b.disabled = true;
    try {
      const result = await this.call("permissions.grant", { permission: { id }, action });
      if (!result?.resolved) this.announce("That request was already answered.");
      this.permissions.delete(id);
      this.renderPermissions();
    } catch (err) {
      for (const b of card.querySelectorAll("button")) b.disabled = false;
      this.toast(`Cannot answer the request: ${err.message}`, "error");
    }
  }

  // -- page chrome ------------------------------------------------------------------------------

  resetWorkspaceView() {
    this.lastSeq = null;
    this.toggles = new Map();
    this.sessions = new Map();
    this.current = null;
    this.runs = new Map();
    this.permissions = new Map();
    this.queued = [];
    this.syncGen++;
    this.loadGen++;
    this.replaceMessages([]);
    $("empty-state").hidden = false;
    $("model-name").textContent = "";
    this.agent = null;
    this.modelChoices = [];
    this.summarizing = null;
    this.summaryProgress = "";
    renderAgent(null);
    renderUsage(null);
    this.renderModelPicker();
    this.renderTrust(null);
    this.renderSessions();
    this.renderSessionHead();
    this.renderRuns();
    this.renderQueue();
    this.renderPermissions();
    this.setEnabled(false);
  }

  toggleSidebar(force) {
    const open = force ?? !document.body.classList.contains("sidebar-open");
    document.body.classList.toggle("sidebar-open", open);
    $("toggle-sidebar").setAttribute("aria-expanded", String(open));
    $("toggle-sidebar").setAttribute("aria-label", open ? "Hide sessions" : "Show sessions");
  }

  toast(text, kind = "info") {
    const el = h("div", { class: `toast toast-${kind}` }, h("span", { text }));
    const close = h("button", {
      type: "button",
      class: "icon-button small",
      "aria-label": "Dismiss",
      text: "×",
      onclick: () => el.remove(),
    });
    el.append(close);
    $("toasts").append(el);
    setTimeout(() => el.remove(), TOAST_MS);
  }

  announce(text) {
    const el = $("announcer");
    el.textContent = "";
    // A separate task so that repeating the same text is announced again.
    setTimeout(() => {
      el.textContent = text;
    }, 50);
  }
}

/** A new, empty part, made by the delta that creates it (its first append). */
function newPart(d) {
  if (d.part_type === "tool_call") {
    return { type: "tool_call", data: { id: d.tool_call_id || "", name: d.tool_name || "", input: "", finished: false } };
  }
  if (d.part_type === "reasoning") {
    return { type: "reasoning", data: { thinking: "", signature: "", started_at: 0, finished_at: 0 } };
  }
  return { type: d.part_type, data: { [STREAMED_FIELD[d.part_type]]: "" } };
}

/** Length of `text` in Unicode code points (the unit of delta offsets), not UTF-16 units. */
function codePoints(text) {
  let n = text.length;
  for (let i = 0; i < text.length - 1; i++) {
    const c = text.charCodeAt(i);
    if (c >= 0xd800 && c <= 0xdbff) {
      const next = text.charCodeAt(i + 1);
      if (next >= 0xdc00 && next <= 0xdfff) {
        n--;
        i++;
      }
    }
  }
  return n;
}

/** `text` without its first `n` code points. */
function dropCodePoints(text, n) {
  let i = 0;
  for (let k = 0; k < n && i < text.length; k++) {
    const c = text.charCodeAt(i);
    const next = text.charCodeAt(i + 1);
    i += c >= 0xd800 && c <= 0xdbff && next >= 0xdc00 && next <= 0xdfff ? 2 : 1;
  }
  return i ? text.slice(i) : text;
}

/** The text of an agent_event: its message (a message object, or text) or its error. */
function agentText(ev) {
  if (typeof ev.text === "string" && ev.text) return ev.text;
  const m = ev.message;
  if (typeof m === "string") return m || ev.error || "";
  if (m && Array.isArray(m.parts)) {
    const text = m.parts.filter((p) => p.type === "text").map((p) => p.data?.text || "").join("");
    if (text) return text;
  }
  return ev.error || "";
}

function sessionTitle(session) {
  return (session && session.title) || "New session";
}

function byNewest(a, b) {
  return (b.created_at || 0) - (a.created_at || 0) || String(b.id).localeCompare(String(a.id));
}

function baseName(path) {
  const parts = String(path).split("/").filter(Boolean);
  return parts[parts.length - 1] || path;
}

const app = new App();
app.init();
// For tests and debugging in the console; holds no secret (the token is an HttpOnly cookie).
window.crushTrio = app;
