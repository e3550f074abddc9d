#!/bin/sh
# Re-fetch the web page's vendored Markdown renderer with npm: marked's ESM build and its
# licence, into zctl/serve/web/static/vendor/ (run from the repository's root; the version
# defaults to the one vendored now). The page loads nothing from elsewhere at run time.
set -eu
VERSION=${1:-18.3.0}
DEST=zctl/serve/web/static/vendor
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "marked@$VERSION" >/dev/null && tar xzf marked-*.tgz)
cp "$tmp/package/lib/marked.esm.js" "$DEST/marked.esm.js"
cp "$tmp/package/LICENSE" "$DEST/marked.LICENSE"
echo "marked $VERSION -> $DEST"
