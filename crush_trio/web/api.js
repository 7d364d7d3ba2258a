// HTTP calls to the /v1 API (PROTOCOL §3). The browser authenticates with the HttpOnly cookie it
// got from opening /?token=..., so no token is handled here. That cookie is scoped to the page's
// path prefix (new at every server start), so every call goes below it too (BASE).

/**
 * The page's path prefix: "/w-<hex>" when the page is served at "/w-<hex>/", "" at "/". API
 * paths and the websocket go below it, the only paths the token cookie is sent to.
 */
export const BASE = location.pathname.replace(/\/[^/]*$/, "");

/** An error answer of the API: the HTTP status and the server's message. */
export class ApiError extends Error {
  constructor(status, message, data = null) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    /** The decoded error body (e.g. a revert's 409 lists `files`). */
    this.data = data;
  }
}

/** Bound on one HTTP request (milliseconds). */
export const HTTP_TIMEOUT_MS = 30000;

/**
 * Send one request and decode its JSON answer.
 * @param {string} method
 * @param {string} path starts with /v1
 * @param {any} [body] sent as JSON
 * @returns {Promise<any>}
 */
export async function request(method, path, body) {
  const init = { method, headers: {}, credentials: "same-origin", signal: AbortSignal.timeout(HTTP_TIMEOUT_MS) };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(BASE + path, init);
  } catch (err) {
    throw new ApiError(0, `cannot reach the server (${err.message || err})`);
  }
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) {
    const message = data && typeof data.message === "string" ? data.message : `HTTP ${response.status}`;
    throw new ApiError(response.status, message, data);
  }
  return data;
}

const enc = encodeURIComponent;

/**
 * The HTTP route of each websocket command (PROTOCOL §5 "Websocket commands"), so a command can
 * be sent over HTTP while the socket is down.
 */
export function httpCommand(wid, method, params = {}) {
  const w = `/v1/workspaces/${enc(wid)}`;
  const sid = params.session_id === undefined ? "" : enc(params.session_id);
  switch (method) {
    case "agent.prompt":
      return request("POST", `${w}/agent`, params);
    case "agent.cancel":
      return request("POST", `${w}/agent/sessions/${sid}/cancel`);
    case "agent.clear_queue":
      return request("POST", `${w}/agent/sessions/${sid}/prompts/clear`);
    case "sessions.create":
      return request("POST", `${w}/sessions`, params);
    case "sessions.list":
      return request("GET", `${w}/sessions`);
    case "messages.list":
      return request("GET", `${w}/sessions/${sid}/messages`);
    case "runs.get":
      return request("GET", `${w}/runs/${enc(params.run_id)}`);
    case "permissions.grant":
      return request("POST", `${w}/permissions/grant`, params);
    default:
      return Promise.reject(new ApiError(404, `unknown method ${method}`));
  }
}

export const api = {
  openWorkspace: (path, clientId) => request("POST", "/v1/workspaces", { path, client_id: clientId }),
  releaseWorkspace: (wid, clientId) =>
    request("DELETE", `/v1/workspaces/${enc(wid)}?client_id=${enc(clientId)}`),
  deleteSession: (wid, sid) => request("DELETE", `/v1/workspaces/${enc(wid)}/sessions/${enc(sid)}`),
  renameSession: (wid, sid, title) =>
    request("PATCH", `/v1/workspaces/${enc(wid)}/sessions/${enc(sid)}`, { title }),
  queuedPrompts: (wid, sid) =>
    request("GET", `/v1/workspaces/${enc(wid)}/agent/sessions/${enc(sid)}/prompts/list`),
  agentInfo: (wid) => request("GET", `/v1/workspaces/${enc(wid)}/agent`),
  pendingPermissions: (wid) => request("GET", `/v1/workspaces/${enc(wid)}/permissions`),
  session: (wid, sid) => request("GET", `/v1/workspaces/${enc(wid)}/sessions/${enc(sid)}`),
  /** One page of sessions, newest created first: `{limit, before?, q?}` (PROTOCOL "Paging"). */
  sessionsPage: (wid, { limit, before, q }) => {
    const query = new URLSearchParams({ limit: String(limit) });
    if (before) query.set("before", before);
    if (q) query.set("q", q);
    return request("GET", `/v1/workspaces/${enc(wid)}/sessions?${query}`);
  },
  providers: (wid) => request("GET", `/v1/workspaces/${enc(wid)}/providers`),
  summarize: (wid, sid) =>
    request("POST", `/v1/workspaces/${enc(wid)}/agent/sessions/${enc(sid)}/summarize`),
  setTrust: (wid, trusted) => request("POST", `/v1/workspaces/${enc(wid)}/trust`, { trusted }),
};
