// "It needs you": while the tab is hidden, a permission request or a failed run puts a count in
// the tab's title and, when the user allowed it, shows a browser notification. The permission to
// notify is asked once, from a button the user presses (never on page load).

/** The page's title without a count in front of it. */
function baseTitle() {
  return document.title.replace(/^\(\d+\) /, "");
}

export class Attention {
  constructor() {
    /** Things that needed the user while the tab was hidden. */
    this.count = 0;
    /** Notifications shown while hidden, closed when the tab is seen again. */
    this.shown = [];
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) this.seen();
    });
  }

  /** Whether the browser can notify and has not been asked yet (the button is offered then). */
  get canAsk() {
    return typeof Notification !== "undefined" && Notification.permission === "default";
  }

  /** Ask for permission to notify (from a click). */
  async ask() {
    if (!this.canAsk) return typeof Notification !== "undefined" ? Notification.permission : "denied";
    try {
      return await Notification.requestPermission();
    } catch {
      return "denied";
    }
  }

  /**
   * Something needs the user (`tag` groups repeats of one thing, e.g. one permission id). Only
   * while the tab is hidden: a visible page shows it already.
   */
  need(text, tag) {
    if (!document.hidden) return;
    this.count += 1;
    document.title = `(${this.count}) ${baseTitle()}`;
    if (typeof Notification !== "undefined" && Notification.permission === "granted") {
      try {
        const note = new Notification("crush_trio needs you", { body: text, tag });
        note.onclick = () => {
          window.focus();
          note.close();
        };
        this.shown.push(note);
      } catch {
        // Some browsers only notify from a service worker; the title badge still shows.
      }
    }
  }

  /** The user is looking again: clear the badge and the notifications. */
  seen() {
    this.count = 0;
    document.title = baseTitle();
    for (const note of this.shown.splice(0)) note.close();
  }
}
